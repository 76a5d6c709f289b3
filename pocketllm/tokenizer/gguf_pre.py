"""How a byte-level BPE vocabulary splits text into words, by its GGUF `tokenizer.ggml.pre` name.

The regexes are llama.cpp's (`src/llama-vocab.cpp`, `LLAMA_VOCAB_PRE_TYPE_*`). Each one splits the pieces
the previous one left, keeping both the matches and the text between them, which is what
`tokenizers.pre_tokenizers.Split(behavior="isolated")` does. Where llama.cpp rewrote a Hugging Face regex
for std::regex (no `(?i:...)`), the original is used: `tokenizers` runs the original, and so did the
reference tokenizers the llama.cpp fixtures were made with.
"""

from dataclasses import dataclass

from pocketllm.errors import UnsupportedFeatureError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss): words split at case changes, with their contractions; digits in threes. llama.cpp's
# std::regex spelling of the letter classes, `(?=[\p{L}])([^a-z])`, splits alike unless a non-ASCII cased letter
# or a combining mark is involved ("aÉ", "e\u0301").
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII ranges are escaped: editors and tools may NFC-normalize literal characters (U+1F7D -> U+03CE).
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    # llama.cpp takes a word whole when the vocabulary has it, before trying merges (Llama 3 family).
    ignore_merges: bool = False
    # llama.cpp's default when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos: bool = False


_LLAMA3_FAMILY = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_FAMILY = PreTokenizer((_GPT2,))
_QWEN2_FAMILY = PreTokenizer((_QWEN2,))
_STARCODER_FAMILY = PreTokenizer((r"\p{N}", _GPT2))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), _GPT2_FAMILY),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"), _LLAMA3_FAMILY),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_FAMILY),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer((_GPT4O,))),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _STARCODER_FAMILY
    ),
    "deepseek-llm": PreTokenizer((r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise UnsupportedFeatureError(
            f"GGUF tokenizer.ggml.pre = {name!r} is not supported; supported: {supported}"
        ) from None
