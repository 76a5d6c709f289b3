"""GGUF tokenizers against llama.cpp's tokenizer fixtures and against transformers on a real model."""

import functools
import timeit

import gguf
import pytest
from fixtures import default_model_gguf, shared_names, shared_path, smollm2_reference

from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.tokenizer import get_tokenizer

VOCABS = shared_names("fixtures/vocab", "ggml-vocab-*.gguf")
_SEPARATOR = "\n__ggml_vocab_test__\n"


def read_cases(vocab_path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of `<vocab>.inp`/`.out`, split the way llama.cpp's test-tokenizer-0 splits them:
    each text is followed by the separator (the last one may not be); each .out line holds one text's ids."""
    texts = shared_path(f"fixtures/vocab/{vocab_path.name}.inp").read_bytes().decode("utf-8").split(_SEPARATOR)
    lines = shared_path(f"fixtures/vocab/{vocab_path.name}.out").read_text().split("\n")
    texts, lines = texts[:-1] if texts[-1] == "" else texts, lines[:-1] if lines[-1] == "" else lines
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


@functools.cache
def vocab_tokenizer(name: str):
    # Reading a large vocabulary takes seconds (gguf.GGUFReader), so each is read once.
    return get_tokenizer(shared_path(f"fixtures/vocab/{name}"))


@pytest.fixture(params=VOCABS)
def vocab(request):
    return vocab_tokenizer(request.param), read_cases(shared_path(f"fixtures/vocab/{request.param}"))


def test_fixtures_are_found():
    # The listing feeds the parametrized tests; an empty one would let them pass vacuously.
    assert len(VOCABS) >= 4


def test_encode_matches_llama_cpp(vocab):
    tokenizer, cases = vocab
    assert len(cases) >= 40
    # llama.cpp's test-tokenizer-0 encodes with add_special=false (and parse_special=false, which changes nothing
    # here: no fixture text holds a special token; the .out files come from Hugging Face tokenizers, which parse).
    mismatches = [(text, ids) for text, ids in cases if tokenizer.encode(text, add_special_tokens=False) != ids]
    assert mismatches == []


def test_decode_round_trips(vocab):
    # llama.cpp's own detokenizer removes spaces before punctuation for some vocabularies ("clean_spaces");
    # ours never does (nor does transformers 5 for BPE), so every fixture text comes back exactly.
    tokenizer, cases = vocab
    for text, _ in cases:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_byte_tokens_decode_as_utf8_decodes_their_bytes():
    """A run of byte-fallback tokens that is not valid UTF-8 (the bytes of a surrogate, a stray
    continuation byte) followed by valid ones: each invalid sequence is one U+FFFD and the valid bytes
    stay, as Python's UTF-8 decoder (and the byte-level BPE decoders) give them. `tokenizers`'
    ByteFallback decoder writes U+FFFD for every byte of such a run, `"` included."""
    tokenizer = vocab_tokenizer("ggml-vocab-llama-spm.gguf")
    byte = {b: tokenizer._backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    word = tokenizer.encode("hello", add_special_tokens=False)
    for raw in (b'\xed\xa9\xa8"', b'\xa9"x', "é\"".encode() + b"\xff", b"\xf0\x9f\x98\x80"):
        ids = word + [byte[b] for b in raw] + word
        assert tokenizer.decode(ids) == "hello" + raw.decode("utf-8", errors="replace") + " hello"
    assert tokenizer.decode(word + [byte[0xed]] + word) == "hello\ufffd hello"


def test_special_tokens_of_fixture_vocabularies():
    llama3 = vocab_tokenizer("ggml-vocab-llama-bpe.gguf")
    assert (llama3.bos_token_id, llama3.eos_token_id) == (128000, 128001)
    assert llama3.eos_token_ids == {128001, 128009}  # <|end_of_text|>, and <|eot_id|> found by its text
    # Llama 3 files without tokenizer.ggml.add_bos_token get BOS, as in llama.cpp.
    assert llama3.encode("Hello world") == [128000, 9906, 1917]
    assert llama3.encode("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False) == [128006, 882, 128007]
    assert llama3.decode([128000, 9906], skip_special_tokens=True) == "Hello"

    spm = vocab_tokenizer("ggml-vocab-llama-spm.gguf")
    assert (spm.bos_token_id, spm.eos_token_id, spm.vocab_size) == (1, 2, 32000)
    assert spm.encode("Hello") == [1, 15043]
    # A text run after a special token gets its own prefix space, as in llama.cpp.
    assert spm.encode("<s>Hello</s>", add_special_tokens=False) == [1, 15043, 2]
    assert spm.decode([1, 15043, 2]) == "<s> Hello</s>"
    assert spm.decode([1, 15043, 2], skip_special_tokens=True) == "Hello"

    qwen2 = vocab_tokenizer("ggml-vocab-qwen2.gguf")
    assert {151643, 151645} <= qwen2.eos_token_ids  # <|endoftext|>, <|im_end|>
    assert qwen2.encode("<|im_start|>user", add_special_tokens=False) == [151644, 872]
    assert qwen2.apply_chat_template([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")


# --- SmolLM2 (pre-tokenizer "smollm") against transformers' GGUF tokenizer


SMOLLM2_TEXTS = [
    "Hello world",
    " Hello, World! How's it going? I'm fine; they'll see.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }  // C++",
    "12345 3.14159 1,000,000 2024-01-31 0x1F 1e-9",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\n\r\nand runs      of spaces",
    "héllo wörld, naïve café; Ελληνικά; русский; 日本語のテキスト; 한국어; العربية",
    "emoji 🦙🚀 😶‍🌫️ ✅ and symbols ©®™ ∑∫√ ←→",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>pocketllm<file_sep>main.py",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smollm2():
    return get_tokenizer(default_model_gguf()), smollm2_reference()


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_matches_transformers(smollm2, text):
    ours, reference = smollm2
    for add_special_tokens in (False, True):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip_special_tokens in (False, True):
        assert ours.decode(ids, skip_special_tokens) == reference.decode(ids, skip_special_tokens=skip_special_tokens)


def test_smollm2_splits_every_digit(smollm2):
    # llama.cpp's "smollm" splits off each digit (as SmolLM2's own tokenizer.json does, with
    # Digits(individual_digits=True)); transformers' GGUF loader keeps GPT-2's " ?\p{N}+" instead, which only
    # shows where a space is merged into the first byte of a non-ASCII digit.
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    ours, reference = smollm2
    text = "in Arabic-Indic digits: ٣٤٥"
    assert ours.encode(text) != reference.encode(text)
    hub_style = Backend.from_str(reference.backend_tokenizer.to_str())
    hub_style.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert all(ours.encode(t) == hub_style.encode(t).ids for t in [text, *SMOLLM2_TEXTS])


def test_smollm2_special_tokens_and_template(smollm2):
    ours, reference = smollm2
    assert ours.vocab_size == len(reference) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert set(reference.all_special_ids) <= ours.all_special_ids
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    for add_generation_prompt in (True, False):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert rendered == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    assert ours.encode(rendered, add_special_tokens=False) == reference.apply_chat_template(
        messages, tokenize=True, return_dict=False
    )


def test_decode_is_fast_enough_for_incremental_detokenization(smollm2):
    tokenizer, _ = smollm2
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, héllo 🦙")[:8]
    seconds = min(timeit.repeat(lambda: tokenizer.decode(ids), number=1000, repeat=5)) / 1000
    assert seconds < 50e-6


# --- metadata handling, on small GGUF files written here


def write_vocab(path, model="gpt2", pre="gpt-2", **extra):
    """A vocabulary-only GGUF: byte-level tokens for "a", "b", "ab", " " plus control tokens."""
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = ["a", "b", "ab", "Ġ", "<s>", "</s>", "<|eot|>", "<|eom|>", "<tool>"]
    types = [gguf.TokenType.NORMAL] * 4 + [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.USER_DEFINED]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(4)
    writer.add_eos_token_id(5)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_metadata_ids_flags_and_templates(tmp_path):
    path = write_vocab(
        tmp_path / "v.gguf",
        eot_token_id=6,
        eom_token_id=7,
        add_bos_token=True,
        add_eos_token=True,
        chat_template=[
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    )
    tokenizer = get_tokenizer(path)
    assert tokenizer.eos_token_ids == {5, 6, 7}
    assert tokenizer.all_special_ids == {4, 5, 6, 7}
    assert tokenizer.encode("ab a<tool>") == [4, 2, 3, 0, 8, 5]
    assert tokenizer.encode("ab a<tool>", add_special_tokens=False) == [2, 3, 0, 8]
    assert tokenizer.decode([4, 2, 3, 0, 8, 5], skip_special_tokens=True) == "ab a<tool>"
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == "<s>hi"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools:1"
    assert tokenizer.apply_chat_template(messages, chat_template="{{ eos_token }}") == "</s>"
    assert get_tokenizer(path, chat_template="X{{ messages[0].content }}").apply_chat_template(messages) == "Xhi"


def test_missing_chat_template_is_a_configuration_error(tmp_path):
    tokenizer = get_tokenizer(write_vocab(tmp_path / "v.gguf"))
    assert tokenizer.chat_template is None
    with pytest.raises(ConfigurationError, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_vocabularies_are_refused(tmp_path):
    with pytest.raises(UnsupportedFeatureError, match="'made-up'.*llama-bpe.*smollm"):
        get_tokenizer(write_vocab(tmp_path / "pre.gguf", pre="made-up"))
    with pytest.raises(UnsupportedFeatureError, match="'t5'"):
        get_tokenizer(write_vocab(tmp_path / "model.gguf", model="t5"))
    with pytest.raises(ConfigurationError):
        get_tokenizer(tmp_path / "missing.gguf")


# --- gpt-oss's o200k vocabulary (pre-tokenizer "gpt-4o") against Hugging Face tokenizers


O200K_TEXTS = [
    "Hello world! How's it going? I'M fine, they'll see. We'VE a'lL DON'T",
    "camelCaseWords HTTPServer XMLHttpRequest iPhone McDonald's",
    "1234567 3.14159 1,000,000 2024-01-31 0x1F",
    "日本語のテキスト 한국어 中文abc 🦙🚀 😶\u200d🌫️ ✅",
    "path/to/file/\nnext line\n\n\n  \r\n\t\ttabs   and  runs of   spaces   ",
    "...!!!??? (parens) [brackets] {braces} <tags> @#$%^&*",
    "ÉCOLE école aÉ naïve Ελληνικά ΑΒΓδ e\u0301t\u0301e",
    " leading space",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def o200k(tmp_path_factory):
    from tiny_harmony import reference_tokenizer, write_gguf_vocab

    reference = reference_tokenizer()
    path = write_gguf_vocab(reference, tmp_path_factory.mktemp("o200k") / "o200k.gguf")
    return get_tokenizer(path), reference


@pytest.mark.parametrize("text", O200K_TEXTS)
def test_gpt4o_matches_tokenizers(o200k, text):
    ours, reference = o200k
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text).ids
    assert ours.encode(text) == ids  # llama.cpp adds no BOS for "gpt-4o" files
    assert ours.decode(ids) == text


def test_gpt4o_splits_as_llama_cpp_where_its_regex_agrees(o200k):
    """llama.cpp runs its own spelling of the o200k regex (`(?=[\\p{L}])([^a-z])` for the upper-case
    classes): the same words on text without non-ASCII cased letters or combining marks. Where they
    differ, the file's tokenizer.json and tiktoken are what the model was trained with."""
    import regex
    from tiny_harmony import LLAMA_CPP_PATTERN, O200K_PATTERN

    ours, _ = o200k

    def words(text):
        return [text[a:b] for _, (a, b) in ours._backend.pre_tokenizer.pre_tokenize_str(text)]

    for text in O200K_TEXTS[:6]:
        assert words(text) == [m.group(0) for m in regex.finditer(LLAMA_CPP_PATTERN, text)]
    assert words("ÉCOLE aÉ") == regex.findall(O200K_PATTERN, "ÉCOLE aÉ") == ["ÉCOLE", " a", "É"]
    assert [m.group(0) for m in regex.finditer(LLAMA_CPP_PATTERN, "ÉCOLE aÉ")] == ["É", "COLE", " aÉ"]


def test_harmony_end_tokens_and_markup(o200k):
    """As llama.cpp reads o200k_harmony: <|return|> and <|call|> end a reply, <|end|> does not (it
    ends one message of it); the message markup survives skip_special_tokens."""
    ours, reference = o200k
    ids = {t: reference.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>", "<|end|>")}
    assert ours.eos_token_id == ids["<|return|>"]
    assert ours.eos_token_ids == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    reply = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    encoded = ours.encode(reply + "<|return|>", add_special_tokens=False)
    assert encoded == reference.encode(reply + "<|return|>").ids
    assert ours.decode(encoded, skip_special_tokens=True) == reply
    assert ours.decode(encoded) == reply + "<|return|>"
