"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of ids (with a few tokens of context before it),
so each new token costs a tiny decode, multi-byte characters split across tokens wait until
they are complete, and leading-space rules of SentencePiece vocabularies stay right.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        # Text that might be the start of a stop string is held back from streaming.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now appears (text is cut there)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        return self._check_stop(start)

    def _check_stop(self, start: int) -> str | None:
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
                return s
        return None

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
