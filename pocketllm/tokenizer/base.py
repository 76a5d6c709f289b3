"""The tokenizer the engine uses, whatever file it came from."""

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from pocketllm.errors import ConfigurationError
from pocketllm.tokenizer.chat_template import render_chat

# The names transformers passes to chat templates (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Characters from which encoding a text lets other threads run (below, the call is brief anyway).
_LONG_TEXT = 16384
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _ByteFallbackDecoder:
    """SentencePiece byte-fallback decoding (Replace "▁" by " ", ByteFallback, Fuse, then Strip of the
    leading spaces) with the bytes of a run of byte tokens decoded as UTF-8 decodes them: an invalid
    sequence becomes one U+FFFD and the valid bytes after it stay. The ByteFallback decoder of
    `tokenizers` writes U+FFFD for every byte token of a run that is not valid UTF-8, so a `"` written
    as <0x22> after a stray byte vanishes (and a JSON string with it)."""

    def __init__(self, backend: tokenizers.Tokenizer, strip: int):
        vocab = backend.get_vocab(with_added_tokens=True)
        self.byte_of = {i: int(m.group(1), 16) for t, i in vocab.items() if (m := _BYTE_TOKEN.fullmatch(t))}
        self.text_of = {i: t.replace("\u2581", " ").encode() for t, i in vocab.items() if i not in self.byte_of}
        for i in backend.get_added_tokens_decoder():  # the control tokens (</s>) that decoding drops
            if not backend.decode([i]):
                self.text_of[i] = b""
        self.strip = strip

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer) -> "_ByteFallbackDecoder | None":
        """The decoder when `backend`'s is the usual byte-fallback sequence, else None."""
        spec = json.loads(backend.to_str()).get("decoder") or {}
        steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
        kinds = [d.get("type") for d in steps]
        if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or steps[0].get("pattern") != {"String": "\u2581"} \
                or steps[0].get("content") != " " or kinds[3:] not in ([], ["Strip"]):
            return None
        strip = steps[3] if kinds[3:] else {"content": " ", "start": 0, "stop": 0}
        if strip.get("content") != " " or strip.get("stop"):
            return None
        return cls(backend, strip["start"])

    def decode(self, ids: Sequence[int], skipped: frozenset) -> str:
        out = bytearray()
        for i in ids:
            if i in skipped:
                continue
            byte = self.byte_of.get(i)
            if byte is None:
                out += self.text_of.get(i, b"")
            else:
                out.append(byte)
        text = out.decode("utf-8", errors="replace")
        n = 0
        while n < self.strip and text[n:n + 1] == " ":
            n += 1
        return text[n:]


class Tokenizer:
    """Text to token ids and back, the model's special tokens, and its chat template.

    `backend` does all the text work; it is built so that `encode(text, add_special_tokens=True)` adds what the
    model wants around a text (usually BOS). A prompt rendered by `apply_chat_template` already holds those
    tokens, so encode it with `add_special_tokens=False`. Special tokens written in the text (`<|im_end|>`) are
    always encoded as themselves, as Hugging Face tokenizers do.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        *,
        extra_eos_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
    ):
        self._backend = backend
        self.special_tokens = dict(special_tokens)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        named_ids = {backend.token_to_id(text) for text in self.special_tokens.values()} - {None}
        self.eos_token_ids = frozenset({self.eos_token_id, *extra_eos_ids} - {None})
        added_special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.all_special_ids = frozenset(added_special | named_ids | self.eos_token_ids)
        self.skipped_ids = frozenset(added_special)  # what decode(..., skip_special_tokens=True) leaves out
        # Named templates (Hugging Face's list form, GGUF's tokenizer.chat_template.<name>); "default" is the main one.
        self.chat_templates = dict(chat_templates or {})

    def _id_of(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its vocabulary entry is at least
        as long: one character per byte, or per character): a text of n characters has at least
        n / max_token_chars tokens."""
        return max(1, max(map(len, self._backend.get_vocab(with_added_tokens=True))))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:
            # `encode` holds the interpreter lock throughout (~1 s for a million characters), and
            # every other thread (a server's engine) waits; `encode_batch` lets them run meanwhile.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def _byte_fallback(self) -> _ByteFallbackDecoder | None:
        return _ByteFallbackDecoder.of(self._backend)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if "\ufffd" in text and self._byte_fallback is not None:  # (rare: only then can it differ)
            return self._byte_fallback.decode(ids, self.skipped_ids if skip_special_tokens else frozenset())
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,  # so that a template variable may be called `self` or `messages`... as transformers allows
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) to the prompt text, as transformers' `apply_chat_template` does."""
        if chat_template is None:
            # Like transformers: a model's tool-use template, when it has one, renders requests with tools.
            chat_template = (tools and self.chat_templates.get("tool_use")) or self.chat_template
        if chat_template is None:
            raise ConfigurationError(
                "this model has no chat template; give one: --chat-template FILE on the command line, "
                "chat_template=... (a Jinja template string) in Python, or get_tokenizer(path, chat_template=...)"
            )
        variables = {**self.special_tokens, **template_kwargs}
        return render_chat(
            chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )
