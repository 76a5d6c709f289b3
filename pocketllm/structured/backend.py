"""xgrammar on the engine's tokenizer: compiled grammars cached by source, one matcher per sequence,
and the batched logits mask. xgrammar is imported at the first constrained request."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict

import torch

from pocketllm.errors import RequestError
from pocketllm.structured.spec import cache_key, kind_of
from pocketllm.tokenizer import harmony_tokens

log = logging.getLogger("pocketllm")

# Special tokens vanish from decoded text, so grammars may not emit them; these stay usable because
# tool-call and reasoning syntaxes are written with them (and gpt-oss's harmony messages).
_MARKERS = frozenset({"[TOOL_CALLS]", "<|python_tag|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
                      *harmony_tokens.MARKUP})


def _flatten(node: dict | None) -> list[dict]:
    if not node:
        return []
    inner = node.get("decoders") or node.get("normalizers") or node.get("pretokenizers")
    return [leaf for n in inner for leaf in _flatten(n)] if inner else [node]


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids):
    """The vocabulary as xgrammar reads it: raw token texts (byte-level "Ġ" forms, SentencePiece "▁"
    and "<0xXX>" forms), `vocab_size` rows (the logits width), special tokens blanked out."""
    import xgrammar as xgr

    backend = tokenizer._backend  # the tokenizers.Tokenizer: only it has the undecoded token texts
    encoded = [""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = text
    for i in tokenizer.all_special_ids:  # a marker that stops (Phi-3's <|end|>) stays a stop token only
        if i < vocab_size and (encoded[i] not in _MARKERS or i in stop_token_ids):
            encoded[i] = ""
    desc = json.loads(backend.to_str())
    kinds = {d.get("type") for d in _flatten(desc.get("decoder")) + _flatten(desc.get("pre_tokenizer"))}
    prefix = False
    if "ByteLevel" in kinds:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif kinds & {"ByteFallback", "Metaspace"} or desc.get("model", {}).get("byte_fallback"):
        vocab_type = xgr.VocabType.BYTE_FALLBACK
        normalizers = _flatten(desc.get("normalizer"))
        prefix = any(n.get("type") == "Prepend" for n in normalizers) or any(
            d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never"
            for d in _flatten(desc.get("pre_tokenizer")))
    else:
        vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=sorted(stop_token_ids), add_prefix_space=prefix)


class GrammarState:
    """A sequence's place in its grammar. It is advanced once per sampled token, when the token
    joins the output (`Request.append_output_token`): recomputing a preempted request's KV replays
    no token, so the matcher never sees one twice."""

    __slots__ = ("matcher", "rejected")

    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.rejected = False

    def accept(self, token_id: int) -> None:
        if not self.rejected and not self.matcher.accept_token(token_id):
            # The mask allows only accepted tokens, so this is a bug: end the sequence, not its grammar.
            log.error("the grammar rejected sampled token %d; ending the sequence", token_id)
            self.rejected = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """The next token's mask into bitmask[row]; False when every token is allowed."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here, short of a stop token that
        would end it: the row after a draft is sampled under the grammar as the draft leaves it, and
        an ended grammar allows no token (its row's logits would all be -inf). A stop token is
        sampled at that row instead. (The matcher is left as it was.)"""
        n = 0
        for t in tokens:
            if self.rejected or not self.matcher.accept_token(t):
                break
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is done."""
        return self.rejected or self.matcher.is_terminated()


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list) -> None:
    """Set logits[row] to -inf wherever row's grammar forbids the token; other rows are untouched."""
    import xgrammar as xgr

    bitmask = torch.empty((logits.shape[0], (logits.shape[1] + 31) // 32), dtype=torch.int32)
    # fill_... returns False for a row that allows every token: nothing to apply there.
    masked = [row for row, s in zip(rows, states) if s.fill_bitmask(bitmask, row)]
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=masked)


_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: |Check failed: \(.*?\) is false: ")

# Compiled grammars kept for reuse, by source: at most this many, holding at most this many bytes
# (a grammar larger than that serves its request and is not kept).
GRAMMAR_CACHE_ENTRIES = 128
GRAMMAR_CACHE_BYTES = 256 << 20


def grammar_compiler(info):
    """An xgrammar compiler without its own cache: it has no entry limit and would keep every
    grammar that our LRU evicts."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)


def compile_spec(compiler, spec: dict):
    """The compiled grammar of a normalized `structured_outputs`; RequestError if it is invalid."""
    from pocketllm.structured.grammars import LABELS, build

    try:
        return compiler.compile_grammar(build(spec))
    except (RuntimeError, ValueError) as e:
        message = _LOG_PREFIX.sub("", str(e)).strip()
        err = RequestError(f"invalid {LABELS[kind_of(spec)]}: {message}")
        err.param = "structured_outputs"
        raise err from None


class StructuredOutputs:
    """The engine's grammar compiler and its LRU of compiled grammars, keyed by (kind, source) and
    bounded by count and bytes. Thread-safe: the server looks grammars up and adds the ones it
    compiled (pocketllm.structured.worker) outside the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = GRAMMAR_CACHE_ENTRIES,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.cached_bytes = 0  # what the grammars in the cache hold
        self._info = None
        self._compiler = None
        self._lock = threading.Lock()  # the cache's: held for moments only (the event loop takes it)
        self._info_lock = threading.Lock()

    def tokenizer_info(self):
        """The vocabulary as xgrammar reads it (built at the first use: it takes about a second)."""
        with self._info_lock:
            if self._info is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer")
                self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._info

    def cached(self, spec: dict):
        """The compiled grammar of `spec` if the cache has it (it becomes the most recent), else None."""
        key = cache_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def remember(self, spec: dict, compiled) -> None:
        """Keep `compiled` as the grammar of `spec`, evicting the least recent ones past the bounds."""
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return
        key = cache_key(spec)
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self.cached_bytes -= old.memory_size_bytes
            self._cache[key] = compiled
            self.cached_bytes += size
            while len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes:
                self.cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes

    def compile(self, spec: dict):
        """The compiled grammar of a normalized `structured_outputs`, compiled on this thread if it
        is not cached; RequestError if it is invalid."""
        compiled = self.cached(spec)
        if compiled is None:
            info = self.tokenizer_info()
            with self._info_lock:
                self._compiler = self._compiler or grammar_compiler(info)
            compiled = compile_spec(self._compiler, spec)
            self.remember(spec, compiled)
        return compiled

    def deserialize(self, text: str):
        """A grammar compiled elsewhere (CompiledGrammar.serialize_json) on this vocabulary."""
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info())

    @staticmethod
    def new_state(compiled) -> GrammarState:
        return GrammarState(compiled)
