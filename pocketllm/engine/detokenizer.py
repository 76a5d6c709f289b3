"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of ids (with a few tokens of context before it),
so each new token costs a tiny decode, multi-byte characters split across tokens wait until
they are complete, and leading-space rules of SentencePiece vocabularies stay right. Every
token's cost is bounded whatever the model emits: special tokens that decoding skips never
enter the window, and a character still incomplete after `_MAX_PENDING` tokens is given up
(written as U+FFFD, as a plain decode writes it), so the window cannot grow.
"""
from __future__ import annotations

from collections.abc import Sequence

_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes: tokens that still leave one incomplete past this never will.
_MAX_PENDING = 8


class StopStrings:
    """A request's stop strings, indexed by their last character: a new character can only
    complete the strings that end with it, so a token's check looks at those alone, each
    compared once against the text's tail (not one scan of the text per string)."""

    def __init__(self, stop: Sequence[str]):
        self.by_last: dict[str, list[str]] = {}
        for s in dict.fromkeys(stop):  # in order, without repeats
            self.by_last.setdefault(s[-1], []).append(s)
        # Text that might be the start of a stop string is held back from streaming.
        self.holdback = max(map(len, stop), default=1) - 1

    def first_match(self, text: str, start: int) -> tuple[int, str] | None:
        """(where it starts, the string) of the stop string completed first by text[start:], the
        longest when several end at the same character."""
        by_last = self.by_last
        for end in range(max(start, 0), len(text)):
            candidates = by_last.get(text[end])
            if candidates:
                found = [s for s in candidates if text.endswith(s, 0, end + 1)]
                if found:
                    s = max(found, key=len)
                    return end + 1 - len(s), s
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: StopStrings | None,
                 include_stop: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.skipped = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        self.holdback = stop.holdback if stop is not None else 0

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now appears (text is cut there)."""
        if token_id in self.skipped:
            return None  # decoding drops it wherever it stands: it adds no text
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        waiting = len(full) <= len(prefix) or full.endswith("\ufffd")
        if waiting and len(self.ids) - self.read_offset < _MAX_PENDING:
            return None  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # The window keeps its last tokens only: they are the context of the next ones.
        del self.ids[:self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        start = len(self.text)
        self.text += delta
        return self._check_stop(start)

    def _check_stop(self, start: int) -> str | None:
        if self.stop is None:
            return None
        # A stop string completed by the new text ends in it; it may begin before it.
        hit = self.stop.first_match(self.text, start)
        if hit is None:
            return None
        i, s = hit
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
