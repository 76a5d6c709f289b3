"""Embedding models in the one engine: a prompt is pooled (last token, mean, first token) from the final
hidden states, in chunks or whole, batched or alone, and equals transformers' hidden states pooled the
same way (fp32, cosine >= 0.99999); sentence-transformers files and a GGUF's pooling_type make a model
an embedding model; `/v1/embeddings` (the official `openai` client) and Ollama's `/api/embed` (the
`ollama` client) serve the vectors; bad input is a 400 in each protocol's shape."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import prompts_of
from live_server import in_process
from tiny_models import make_tiny_chat_model

from pocketllm import LLM, PoolingParams, RequestError
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig

LENGTHS = [1, 7, 40, 23]


def reference(model, ids: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None):
    """transformers' last hidden states of `ids`, pooled."""
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling][:dimensions]
    return F.normalize(v, dim=0) if normalize else v


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    assert float(F.cosine_similarity(got, want, dim=0)) >= 0.99999
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def make_sentence_transformers(path, pooling: str, normalize: bool = True) -> None:
    """The files sentence-transformers saves beside a model: its modules and its Pooling's config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{key: key == modes[pooling] for key in modes.values()}}))


@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("exact", [True, False])
def test_pooled_prompts_are_transformers_hidden_states_pooled(tiny_models, kind, exact):
    model, path = tiny_models[kind]
    prompts = prompts_of(LENGTHS, seed=3)
    # 16-token steps: the longer prompts are pooled over chunks (mean's sum is carried between them)
    llm = LLM(str(path), device="cpu", dtype="float32", task="embed", exact_kernels=exact, max_num_batched_tokens=16,
              num_kv_blocks=32)
    for pooling in ("last", "mean", "cls"):
        params = PoolingParams(pooling=pooling)
        batched = llm.embed([{"prompt_token_ids": p} for p in prompts], params)
        for ids, out in zip(prompts, batched):
            assert out.finished and out.outputs[0].finish_reason == "stop"
            assert_close(out.embedding, reference(model, ids, pooling))
        alone = llm.embed({"prompt_token_ids": prompts[2]}, params)[0]
        assert_close(alone.embedding, torch.tensor(batched[2].embedding))
    # Matryoshka: the first dimensions, then normalized; unnormalized when asked
    out = llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(pooling="mean", dimensions=16, normalize=False))
    assert_close(out[0].embedding, reference(model, prompts[1], "mean", normalize=False, dimensions=16))
    llm.engine.check_no_leaks()


def test_a_sentence_transformers_model_or_its_gguf_is_an_embedding_model(tiny_models, tmp_path):
    import shutil

    from pocketllm.loaders.gguf_writer import write_gguf

    model, src = tiny_models["qwen3"]
    path = tmp_path / "qwen3-embed"
    shutil.copytree(src, path)
    make_sentence_transformers(path, "mean")
    prompts = prompts_of([5, 30], seed=4)
    llm = LLM(str(path), device="cpu", dtype="float32", exact_kernels=True)
    assert llm.engine.task == "embed"  # inferred from the files
    for ids, out in zip(prompts, llm.embed([{"prompt_token_ids": p} for p in prompts])):
        assert_close(out.embedding, reference(model, ids, "mean"))
    with pytest.raises(RequestError, match="this model serves embeddings"):
        llm.generate({"prompt_token_ids": prompts[0]})
    # convert_hf_to_gguf's mark: the GGUF file's pooling_type; read back as the same embedding model
    gguf_path = write_gguf(path, tmp_path / "qwen3-embed.F32.gguf", "F32").path
    gllm = LLM(str(gguf_path), device="cpu", exact_kernels=True)
    assert gllm.engine.task == "embed" and gllm.engine.model_config.pooling == "mean"
    for ids, out in zip(prompts, gllm.embed([{"prompt_token_ids": p} for p in prompts])):
        assert_close(out.embedding, reference(model, ids, "mean"))
    # a generative model embeds only when asked to (--task embed), with its last token by default
    plain = LLM(str(src), device="cpu", dtype="float32", exact_kernels=True)
    with pytest.raises(RequestError, match="this model serves generation"):
        plain.embed({"prompt_token_ids": prompts[0]})
    asked = LLM(str(src), device="cpu", dtype="float32", exact_kernels=True, task="embed")
    assert_close(asked.embed({"prompt_token_ids": prompts[0]})[0].embedding, reference(model, prompts[0], "last"))
    with pytest.raises(ConfigurationError, match="task must be one of auto, generate, embed"):
        LLM(str(src), device="cpu", task="classify")
    with pytest.raises(RequestError, match="dimensions must be at most the model's 64"):
        asked.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=65))
    with pytest.raises(RequestError, match="pooling must be one of last, mean, cls"):
        PoolingParams(pooling="max")


def test_pooling_survives_prefix_hits_and_preemption(tiny_models):
    """A last-token vector may start from cached blocks (its last token is computed); mean and cls never
    take hits. Two KV blocks too few for the batch: requests are preempted and recomputed."""
    model, path = tiny_models["llama"]
    prompts = prompts_of([40, 40, 40, 33], seed=5)
    prompts[1][:32] = prompts[0][:32]  # a shared prefix of two full blocks
    llm = LLM(str(path), device="cpu", dtype="float32", task="embed", exact_kernels=True, max_num_batched_tokens=64,
              num_kv_blocks=8)
    for pooling in ("last", "mean", "cls"):
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling=pooling))
        for ids, out in zip(prompts, outs):
            assert_close(out.embedding, reference(model, ids, pooling))
    llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(pooling="last"))
    hit = llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(pooling="last"))[0]
    assert hit.num_cached_tokens == 32
    assert_close(hit.embedding, reference(model, prompts[1], "last"))
    assert llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(pooling="mean"))[0].num_cached_tokens == 0
    llm.engine.check_no_leaks()


def make_encoder(arch: str, root):
    """A random two-layer BERT-family encoder saved by transformers: (model, directory)."""
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(vocab_size=384, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, type_vocab_size=2,
                                                 max_position_embeddings=130, pad_token_id=1)
    torch.manual_seed(7)
    model = getattr(transformers, f"{arch}Model")(cfg).eval()
    with torch.no_grad():  # larger than the default init, and random norms and biases: every term counts
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.08 if p.dim() >= 2 else 0.1)
    model.save_pretrained(root / arch)
    return model, root / arch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("arch", ["Bert", "XLMRoberta"])
def test_encoders_pool_what_transformers_computes(tmp_path, arch, device):
    model, path = make_encoder(arch, tmp_path)
    make_sentence_transformers(path, "cls")
    g = torch.Generator().manual_seed(6)
    longest = 128 if arch == "XLMRoberta" else 130  # XLM-R counts its 130 positions from 2
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 57, longest)]
    llm = LLM(str(path), device=device, dtype="float32", max_num_seqs=3)
    assert llm.engine.task == "embed" and llm.engine.max_model_len == longest
    for pooling in ("cls", "mean", "last"):
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling=pooling))
        with torch.no_grad():
            hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
        for out, h in zip(outs, hidden):
            want = F.normalize({"cls": h[0], "mean": h.mean(0), "last": h[-1]}[pooling], dim=0)
            assert_close(out.embedding, want)
        assert_close(llm.embed({"prompt_token_ids": prompts[2]}, PoolingParams(pooling=pooling))[0].embedding,
                     torch.tensor(outs[2].embedding))
    with pytest.raises(RequestError, match=f"more than max_model_len={longest}"):
        llm.embed({"prompt_token_ids": [5] * (longest + 1)})
    llm.engine.check_no_leaks()
    with pytest.raises(UnsupportedFeatureError, match="is an encoder: it serves embeddings"):
        LLM(str(path), device="cpu", task="generate")


def make_wordpiece_bert(root):
    """A random BERT with a lowercasing WordPiece tokenizer (specials, letters, words, ## pieces), saved by
    transformers: (model, its tokenizer, directory)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = ("the a of to and in is it you that he was for on are with as his they be at one have this from or "
             "by word but what some we can out other were all there when up use your how said each which do time "
             "if will way about many then write would like so make see two has look more day could go come did "
             "number no most people my over know water than call first who may down been now find").split()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [*"abcdefghijklmnopqrstuvwxyz", *("##" + c for c in "abcdefghijklmnopqrstuvwxyz"), *".,!?'"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + letters + words + ["##s", "##ing", "##ed", "##er"]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                                sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(8)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.08 if p.dim() >= 2 else 0.1)
    model.save_pretrained(root / "bert-wp")
    fast.save_pretrained(root / "bert-wp")
    return model, fast, root / "bert-wp"


@pytest.mark.parametrize("file_type, cosine", [("F32", 0.99999), ("Q8_0", 0.9999)])
def test_a_bert_gguf_tokenizes_and_embeds_as_transformers(tmp_path, file_type, cosine):
    """BERT written as llama.cpp's `bert` GGUF (its tensor names, its WordPiece vocabulary with the
    converter's phantom spaces, pooling_type CLS): the file's tokenizer gives the Hugging Face tokenizer's
    ids, and the vectors are transformers' (Q8_0: within its rounding)."""
    from pocketllm.loaders.gguf_writer import write_gguf

    model, hf_tokenizer, path = make_wordpiece_bert(tmp_path)
    gguf_path = write_gguf(path, tmp_path / f"bert.{file_type}.gguf", file_type).path
    llm = LLM(str(gguf_path), device="cpu")
    assert llm.engine.task == "embed" and llm.engine.model_config.pooling == "cls"
    texts = ["The word of the day is water.", "They could go UP, down, or over!", "Zebras were unknowable", "a"]
    outs = llm.embed(texts)
    for text, out in zip(texts, outs):
        ids = hf_tokenizer(text)["input_ids"]
        assert llm.get_tokenizer().encode(text) == ids and out.prompt_token_ids == ids
        with torch.no_grad():
            want = F.normalize(model(torch.tensor([ids])).last_hidden_state[0, 0], dim=0)
        assert float(F.cosine_similarity(torch.tensor(out.embedding), want, dim=0)) >= cosine
    llm.engine.check_no_leaks()


def test_a_nomic_bert_gguf_embeds_as_llama_cpp(tmp_path):
    """Nomic BERT (rotary positions, SwiGLU, no biases) has no Hugging Face class: its reference is llama.cpp's
    llama-embedding on the same seeded file (tests/data/nomic_bert_llamacpp.json), mean-pooled and
    normalized as the file's pooling_type says; the texts also go through both WordPiece tokenizers."""
    from nomic_bert_file import write_nomic_bert

    record = json.loads((Path(__file__).parent / "data" / "nomic_bert_llamacpp.json").read_text())
    _, _, tokenizer_dir = make_wordpiece_bert(tmp_path)
    path = write_nomic_bert(tmp_path / "nomic-bert.gguf", tokenizer_dir)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["file_sha256"], \
        "not the file llama.cpp embedded: run benchmarks/tools/record_nomic_bert.sh again"
    llm = LLM(str(path), device="cpu")
    assert llm.engine.task == "embed" and llm.engine.model_config.pooling == "mean"
    for out, want in zip(llm.embed(record["texts"]), record["embeddings"]):
        got, want = torch.tensor(out.embedding), torch.tensor(want)
        # (llama.cpp's CPU graph rounds some intermediates through fp16: 3e-5 apart on unit vectors)
        assert float(F.cosine_similarity(got, want, dim=0)) >= 0.99999 and float((got - want).abs().max()) < 1e-4
    llm.engine.check_no_leaks()


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    """A one-layer llama with the default model's tokenizer, made a mean-pooling embedding model."""
    import transformers

    path = make_tiny_chat_model(tmp_path_factory.mktemp("embed"))
    make_sentence_transformers(path, "mean")
    llm = LLM(str(path), device="cpu", dtype="float32", exact_kernels=True, max_model_len=256)
    assert llm.engine.task == "embed"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with in_process(create_app(AsyncLLM(llm.engine), ServerConfig(model_name="tiny-embed"))) as url:
        yield url, llm, model
    llm.engine.check_no_leaks()


TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "x"]


def test_openai_embeddings_create(embed_server):
    import openai  # (here: the GPU's suites run this file without the clients)

    url, llm, model = embed_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tok = llm.get_tokenizer()
    want = [reference(model, tok.encode(t), "mean") for t in TEXTS]
    # the client asks for base64 unless told otherwise, and decodes it; asked for by name, it is left as text
    for fmt in ("base64", "float", openai.NOT_GIVEN):
        reply = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny-embed"
        for d, w in zip(reply.data, want):
            vector = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            assert_close(list(map(float, vector)), w)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    one = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=8, encoding_format="float")
    assert_close(one.data[0].embedding, F.normalize(reference(model, tok.encode(TEXTS[0]), "mean", False)[:8], dim=0))
    ids = tok.encode(TEXTS[1])
    by_ids = client.embeddings.create(model="tiny-embed", input=[ids, ids[:3]], encoding_format="float")
    assert_close(by_ids.data[0].embedding, want[1])
    assert_close(by_ids.data[1].embedding, reference(model, ids[:3], "mean"))


@pytest.mark.parametrize("body, match", [
    ({"input": []}, "'input' must not be empty"),
    ({"input": [""]}, "empty string"),
    ({"input": "hi", "dimensions": 33}, "dimensions must be at most the model's 32"),
    ({"input": [[1, 2, 10**9]]}, "out of range"),
    ({"input": "word " * 400}, "maximum context length is 256 tokens"),
    ({"input": ["a"] * 2049}, "at most 2048"),
    ({"input": "hi", "encoding_format": "int8"}, "Supported values are: 'float' or 'base64'"),
    ({"input": "hi", "model": "other"}, "does not exist"),
])
def test_bad_embedding_requests_are_openai_400s(embed_server, body, match):
    url, llm, _ = embed_server
    reply = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    assert match in reply.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny-embed", "messages": [{"role": "user", "content": "hi"}]}
                      ).json()["error"]["code"] == "model_not_supported"


def test_ollama_embed(embed_server):
    import ollama

    url, llm, model = embed_server
    client = ollama.Client(host=url, timeout=60)
    tok = llm.get_tokenizer()
    reply = client.embed(model="tiny-embed", input=TEXTS)
    assert reply.model == "tiny-embed" and reply.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS)
    for got, text in zip(reply.embeddings, TEXTS):
        assert_close(list(got), reference(model, tok.encode(text), "mean"))
    # Ollama cuts a long input to the context unless told not to
    long = "word " * 400
    cut = client.embed(model="tiny-embed", input=long)
    assert_close(list(cut.embeddings[0]), reference(model, tok.encode(long)[:256], "mean"))
    with pytest.raises(ollama.ResponseError, match="maximum context length"):
        client.embed(model="tiny-embed", input=long, truncate=False)
    legacy = client.embeddings(model="tiny-embed", prompt=TEXTS[0])
    assert_close(list(legacy.embedding), reference(model, tok.encode(TEXTS[0]), "mean"))
    bad = httpx.post(f"{url}/api/embed", json={"model": "tiny-embed", "input": []})
    assert bad.status_code == 400 and "must not be empty" in bad.json()["error"]
