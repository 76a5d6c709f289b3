"""Tokenizers built from a GGUF file's `tokenizer.*` metadata, tokenizing as llama.cpp does.

Each vocabulary type becomes a `tokenizers.Tokenizer` (BPE model, pre-tokenizer, decoder), so the per-token
work runs in Rust; this module only translates llama.cpp's rules into that pipeline.
"""

import logging
import os
from collections.abc import Sequence

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.gguf_file import GGUFFile
from pocketllm.tokenizer import harmony_tokens as harmony
from pocketllm.tokenizer.base import Tokenizer
from pocketllm.tokenizer.gguf_pre import pre_tokenizer_for

logger = logging.getLogger(__name__)
K = gguf.Keys.Tokenizer
T = gguf.TokenType

# Tokens that end a turn, found by their text: files often lack `tokenizer.ggml.eot_token_id` (llama.cpp does
# the same, in llama-vocab.cpp).
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<EOT>", "_<EOT>", "<end_of_utterance>", "<eos>", "<turn|>", "<|return|>", "<|call|>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's <｜end▁of▁sentence｜>
    }
)  # fmt: skip
# o200k_harmony (gpt-oss) writes a reply as messages: <|end|> closes one of them, <|return|> and <|call|> end the
# reply, and the message markup stays in decoded text, where reply parsers read it (llama.cpp does the same).
_HARMONY_ENDS = (harmony.RETURN, harmony.CALL)
_HARMONY_MARKUP = frozenset(harmony.MARKUP)
_SPACE = "\u2581"  # SentencePiece writes spaces as "▁"


class _Metadata:
    def __init__(self, reader: gguf.GGUFReader):
        self._reader = reader

    def get(self, key: str, default=None):
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def named_chat_templates(self) -> dict[str, str]:
        prefix = K.CHAT_TEMPLATE + "."
        templates = {
            key[len(prefix) :]: field.contents() for key, field in self._reader.fields.items() if key.startswith(prefix)
        }
        default = self.get(K.CHAT_TEMPLATE)
        return templates | ({"default": default} if default is not None else {})


def gguf_chat_templates(path: str | os.PathLike) -> dict[str, str]:
    return _Metadata(GGUFFile(path)).named_chat_templates()


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    return tokenizer_from_gguf(GGUFFile(path))


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer described by an open GGUF file (a loader that has the reader open can pass it)."""
    meta = _Metadata(reader)
    tokens: list[str] = meta.get(K.LIST)
    if tokens is None:
        raise ConfigurationError("this GGUF file has no tokenizer (no tokenizer.ggml.tokens); pass a tokenizer path")
    types: list[int] = meta.get(K.TOKEN_TYPE) or [T.NORMAL] * len(tokens)
    kind = meta.get(K.MODEL)
    if kind == "gpt2":
        backend, add_bos_default = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend, add_bos_default = _sentencepiece_bpe(meta, tokens), True
    elif kind == "gemma4":
        backend, add_bos_default = _gemma4_bpe(meta, tokens), False
    elif kind == "bert":
        backend, add_bos_default = _wordpiece(meta, tokens), True
    else:
        raise UnsupportedFeatureError(
            f"GGUF tokenizer.ggml.model = {kind!r} is not supported; supported: 'gpt2', 'llama', 'gemma4', 'bert'"
        )

    ids = {name: meta.get(key) for name, key in _SPECIAL_IDS.items()}
    if kind == "bert":  # llama.cpp's WPM defaults: [CLS] as BOS, [SEP] after the text
        ids["bos_token"] = ids["bos_token"] if ids["bos_token"] is not None else _index(tokens, "[CLS]")
        ids["sep_token"] = ids["sep_token"] if ids["sep_token"] is not None else _index(tokens, "[SEP]")
    special_tokens = {name: tokens[i] for name, i in ids.items() if i is not None}
    end_ids = {meta.get(K.EOT_ID), meta.get(K.EOM_ID)} | {i for i, t in enumerate(tokens) if t in _END_OF_TURN_TEXTS}
    end_ids.discard(None)
    rendered = set()
    if all(text in {tokens[i] for i in end_ids} for text in _HARMONY_ENDS):
        rendered = {i for i, t in enumerate(tokens) if t in _HARMONY_MARKUP}
        end_ids -= rendered
    _add_special_tokens(backend, tokens, types, end_ids, rendered)
    # What encode(add_special_tokens=True) adds around a text; `single` is a list as token texts may hold spaces.
    bos = [ids["bos_token"]] if meta.get(K.ADD_BOS, add_bos_default) and ids["bos_token"] is not None else []
    eos = [ids["eos_token"]] if meta.get(K.ADD_EOS, False) and ids["eos_token"] is not None else []
    if kind == "bert" and meta.get(K.ADD_SEP, True) and ids["sep_token"] is not None:
        eos = [ids["sep_token"]]
    backend.post_processor = processors.TemplateProcessing(
        single=[tokens[i] for i in bos] + ["$A"] + [tokens[i] for i in eos],
        special_tokens=[(tokens[i], i) for i in bos + eos],
    )
    return Tokenizer(backend, special_tokens, extra_eos_ids=end_ids, chat_templates=meta.named_chat_templates())


_SPECIAL_IDS = {
    "bos_token": K.BOS_ID,
    "eos_token": K.EOS_ID,
    "unk_token": K.UNK_ID,
    "sep_token": K.SEP_ID,
    "pad_token": K.PAD_ID,
    "mask_token": K.MASK_ID,
}


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> tuple[Backend, bool]:
    pre_name = meta.get(K.PRE)
    if pre_name is None:
        logger.warning("GGUF file has no tokenizer.ggml.pre; splitting words like llama.cpp's 'default', which may "
                       "not match the model's tokenizer (regenerate the file with a current llama.cpp)")  # fmt: skip
    pre = pre_tokenizer_for(pre_name or "default")
    backend = Backend(
        models.BPE(_vocab(tokens), _split_merges(meta.get(K.MERGES, [])), ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str]) -> Backend:
    """llama.cpp's SPM tokenizer: spaces become "▁", one "▁" goes in front of every text run (unless the file says
    otherwise), then the best-scoring adjacent pair is merged repeatedly; characters outside the vocabulary become
    `<0xXX>` byte tokens."""
    scores = meta.get(K.SCORES)
    if scores is None:
        raise ConfigurationError("SentencePiece GGUF vocabulary without tokenizer.ggml.scores")
    unk_id = meta.get(K.UNK_ID, 0)
    backend = Backend(
        models.BPE(
            _vocab(tokens),
            _merges_from_scores(tokens, scores),
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = meta.get(K.ADD_PREFIX, True)
    steps = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    # Per text run: special tokens split the text first, so each run after one gets its own "▁", as in llama.cpp.
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return backend


def _index(tokens: list[str], text: str) -> int | None:
    return tokens.index(text) if text in tokens else None


def _wordpiece(meta: _Metadata, tokens: list[str]) -> Backend:
    """llama.cpp's WPM tokenizer (BERT): text lowercased with accents stripped, split at spaces and
    punctuation, each word cut into the longest pieces of the vocabulary. The file writes a word-initial
    piece with a leading "▁" and a continuing piece bare (its converter's "phantom space"); WordPiece's
    own form, "word" and "##piece", is restored here."""
    def piece(token: str) -> str:
        if token.startswith(_SPACE):
            return token[1:]
        return token if token.startswith("[") and token.endswith("]") else "##" + token

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(piece(token), i)
    unk = tokens[meta.get(K.UNK_ID, _index(tokens, "[UNK]") or 0)]
    backend = Backend(models.WordPiece(vocab, unk_token=piece(unk), max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return backend


def _gemma4_bpe(meta: _Metadata, tokens: list[str]) -> Backend:
    """Gemma 4 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4): BPE merges over raw UTF-8 with spaces as "▁", no prefix
    space, text split only into lines and newline runs, `<0xXX>` byte tokens for the rest."""
    backend = Backend(models.BPE(_vocab(tokens), _split_merges(meta.get(K.MERGES, [])), byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A text listed twice keeps its last id, like llama.cpp's token_to_id.
    return {token: i for i, token in enumerate(tokens)}


def _split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    # Split at the first space after the first character, as llama.cpp does, so a merge may start with " ".
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _merges_from_scores(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece vocabularies store scores, not merges. llama.cpp merges the adjacent pair whose joined text
    is the best-scoring token; as a BPE merge list, that is every split of every token, best token first."""
    ids = _vocab(tokens)
    ranked = []
    for token_id, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(
    backend: Backend, tokens: list[str], types: Sequence[int], end_ids: set[int], rendered: set[int]
) -> None:
    """Control, unknown and user-defined tokens are matched whole in the text (llama.cpp always matches user-defined
    ones, and control ones when parsing specials, as Hugging Face tokenizers always do). Control and unknown
    tokens, and any end-of-turn token, are special: `decode(skip_special_tokens=True)` drops them; `rendered`
    control tokens are kept, as user-defined ones are."""
    special = [i for i, t in enumerate(types) if (t in (T.CONTROL, T.UNKNOWN) or i in end_ids) and i not in rendered]
    plain = [i for i, t in enumerate(types) if (t == T.USER_DEFINED or i in rendered) and i not in end_ids]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in plain])
