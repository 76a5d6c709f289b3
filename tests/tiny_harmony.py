"""Small stand-ins for gpt-oss's o200k_harmony vocabulary and for a gpt-oss model that writes
harmony, for the pre-tokenizer, harmony and server tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parent / "data" / "openai-gpt-oss-120b.jinja"

# The split regex as o200k's tokenizer.json (and tiktoken's o200k_base) writes it.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# llama.cpp's std::regex spelling of it (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O).
LLAMA_CPP_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]"
    r"|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]"
    r"|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k_harmony's named special tokens, in id order.
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
            "<|message|>", "<|call|>"]
CORPUS = ["Hello world! How's it going? I'M fine, they'll see. We've got 1234567 items/day.",
          "camelCaseWords and HTTPServer; naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
          "def f(x):\n    return x * 2  # doubled\n\n\tTabs\r\nand emoji 🦙🚀 ✅"] * 3


def reference_tokenizer(vocab_size: int = 420):
    """A byte-level BPE learned from CORPUS by Hugging Face tokenizers with o200k's pre-tokenizer
    (Split on the regex above, then ByteLevel), plus the harmony special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def write_gguf_vocab(tok, path: Path, pre: str = "gpt-4o", chat_template: str | None = None) -> Path:
    """`tok` as a GGUF vocabulary (as llama.cpp's converter writes gpt-oss's: specials as control tokens,
    <|return|> as EOS)."""
    import gguf

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(vocab["<|startoftext|>"])
    writer.add_eos_token_id(vocab["<|return|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


# What the model below writes, token by token (one token's text each): reasoning, then the answer.
# The answer's header is one ordinary token, as its <|channel|> may not follow two tokens at once.
REPLY = ["<|channel|>", "analysis", "<|message|>", "Need", " weather", ".", "<|end|>", "<|start|>", "assistant",
         "<|channel|>final<|message|>", "Sunny", "!", "<|return|>"]


def make_harmony_model(root: Path) -> Path:
    """A tiny gpt-oss GGUF (F32) with an o200k-style byte-level vocabulary, harmony's special tokens and
    gpt-oss's chat template, whose weights make it a bigram model: attention and experts add nothing,
    so the logits depend on the last token only, and greedy decoding writes REPLY after any prompt
    (which ends with "<|start|>assistant"). Under a grammar, each step takes the likeliest allowed
    token: the reasoning, then the constraint."""
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from pocketllm.loaders.gguf_writer import write_gguf

    path = root / "harmony-tiny"
    path.mkdir(parents=True, exist_ok=True)
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    words = [w.replace(" ", "\u0120") for w in REPLY if w not in SPECIALS and w not in byte_chars]
    vocab = {t: i for i, t in enumerate(sorted(byte_chars) + words)}
    tok = Tokenizer(models.BPE(vocab, []))  # no merges: prompts are bytes, REPLY's words only come out
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE.read_text(encoding="utf-8")}))
    ids = [tok.token_to_id(t.replace(" ", "\u0120")) for t in REPLY]

    cfg = transformers.GptOssConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        sliding_window=8, swiglu_limit=7.0, max_position_embeddings=4096, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()  # the residual stream stays the token's embedding
            elif "norm" in name:
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        unit = emb / emb.norm(dim=1, keepdim=True)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        prompt_end = tok.token_to_id("t")  # "...<|start|>assistant" ends with this byte
        for before, after in zip([prompt_end] + ids, ids):
            head[after] += 40.0 * unit[before] / 8.0  # RMS-normed rows are 8 (= sqrt(64)) long
    model.save_pretrained(path, safe_serialization=True)
    return write_gguf(path, root / "harmony-tiny.F32.gguf", "F32").path
