"""LoRA adapters (PEFT directories) against transformers + peft on the same random weights: each
adapter's greedy tokens and logits, adapters and the base model mixed in one batch, fewer slots than
adapters, the prefix cache kept apart per adapter, unload and reload, and what is refused."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import prompts_of
from reference import hf_greedy

from pocketllm import LLM, LoRARequest, SamplingParams
from pocketllm.errors import ConfigurationError, RequestError

NEW = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model, path, seed: int, r: int, targets, alpha: float = 16, rslora: bool = False):
    """A PEFT adapter of random A and B (not the zero B PEFT starts training from), saved at `path`; returns
    transformers' model with it applied (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(path)
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """The tiny Llama and two adapters: rank 8 on every projection; rank 4 (rsLoRA) on q, v and down."""
    model, path = tiny_models["llama"]
    root = tmp_path_factory.mktemp("lora")
    refs = {"a": make_adapter(model, root / "a", 1, 8, ALL),
            "b": make_adapter(model, root / "b", 2, 4, ["q_proj", "v_proj", "down_proj"], alpha=8, rslora=True)}
    return model, path, {name: str(root / name) for name in refs}, refs


def _engine(path, dirs, device="cpu", **kw):
    return LLM(str(path), device=device, dtype="float32", max_model_len=128, num_kv_blocks=64, enable_lora=True,
               lora_modules=[f"{n}={p}" for n, p in dirs.items()], **kw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_adapters_and_the_base_model_in_one_batch_give_transformers_peft_tokens(adapters, device):
    model, path, dirs, refs = adapters
    prompts = prompts_of([5, 23, 12])
    want = {name: [hf_greedy(ref, p, NEW) for p in prompts] for name, ref in refs.items()}
    want[None] = [hf_greedy(model, p, NEW) for p in prompts]
    assert want["a"] != want[None] and want["b"] != want[None], "the adapters change the tokens"
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    jobs = [(p, i, name) for name in ("a", None, "b") for i, p in enumerate(prompts)]
    for max_loras in (2, 1):  # two slots: all at once; one: each adapter's requests wait for the other's
        llm = _engine(path, dirs, device, max_loras=max_loras)
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in jobs], params, use_tqdm=False,
                            lora_request=[name and LoRARequest(name) for _, _, name in jobs])
        for (_, i, name), out in zip(jobs, outs):
            assert list(out.outputs[0].token_ids) == want[name][i], (max_loras, name, i)
        # (--max-cpu-loras defaults to --max-loras: with one slot, one adapter is kept read and the other read again)
        assert len(llm.engine.lora.host) == max_loras


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")
def test_the_gpus_grouped_kernels_give_transformers_peft_tokens(adapters, monkeypatch):
    """The GPU's kernels (Triton's interpreter on CPU tensors): rows sorted by adapter, each slot's rows
    multiplied by its own A and B (kernels/triton/lora.py), in a batch mixing both adapters and the base."""
    from pocketllm.kernels import platform

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})
    model, path, dirs, refs = adapters
    prompts = prompts_of([5, 12])
    jobs = [(p, name) for p in prompts for name in ("a", None, "b")]
    llm = _engine(path, dirs, max_loras=2)
    assert llm.engine.lora.rows.grouped
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False, lora_request=[name and LoRARequest(name) for _, name in jobs])
    for (p, name), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(refs.get(name, model), p, 8), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")
def test_grouped_adapter_products_equal_the_masked_ones():
    """The two ways of layers.lora on random slots: more rows of a slot than one chunk, rows without an
    adapter, a slot no row uses, and a grid of more chunks than needed (as a CUDA graph's is)."""
    from pocketllm.layers.lora import LoRARows, LoRASlots

    torch.manual_seed(0)
    slots = [2, -1, 0, 2, 2, -1] + [0] * 19 + [2]
    x = torch.randn(len(slots), 40)
    got = {}
    for grouped in (True, False):
        rows = LoRARows(4, torch.device("cpu"), grouped=grouped, capacity=64)
        layer = LoRASlots(40, [24, 8], rows, max_rank=8, dtype=torch.float32, device="cpu")
        g = torch.Generator().manual_seed(1)
        for slot, rank in ((0, 8), (2, 3), (3, 5)):
            for part, out in enumerate((24, 8)):
                layer.put(slot, part, torch.randn(rank, 40, generator=g), torch.randn(out, rank, generator=g))
        rows.set(slots)
        if grouped:
            rows.grid += 2
        y = torch.randn(len(slots), 32, generator=torch.Generator().manual_seed(2))
        got[grouped] = layer.add(x, y.clone(), layer.begin(x))
        assert torch.equal(got[grouped][[1, 5]], y[[1, 5]]), "rows without an adapter are untouched"
    assert torch.allclose(got[True], got[False], rtol=1e-5, atol=1e-5)


def test_two_tensor_parallel_ranks_give_transformers_peft_tokens(adapters):
    """Two ranks (gloo), each holding its share of every adapter as of its layers (B's rows for the
    column-parallel projections, A's columns for the row-parallel ones), filled as rank 0 fills its slots:
    one slot for two adapters, so the ranks' slots change mid-run."""
    model, path, dirs, refs = adapters
    prompts = prompts_of([5, 17])
    jobs = [(p, name) for p in prompts for name in ("a", None, "b")]
    llm = _engine(path, dirs, max_loras=1, tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], SamplingParams(
            temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False,
            lora_request=[name and LoRARequest(name) for _, name in jobs])
    finally:
        llm.shutdown()
    for (p, name), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(refs.get(name, model), p, NEW), name


def test_speculative_decoding_verifies_drafts_under_each_requests_adapter(adapters):
    """n-gram drafts are verified as decode rows of the request's own adapter: the tokens stay peft's."""
    _, path, dirs, refs = adapters
    prompts = [p * 3 for p in prompts_of([6, 9])]  # (repeats, so that lookups find drafts)
    llm = _engine(path, dirs, max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    llm.engine.speculator.draft_length.limit = lambda req, cost: 3  # drafts at every step they are found
    jobs = [(p, name) for p in prompts for name in ("a", "b", None)]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], SamplingParams(temperature=0, max_tokens=NEW,
                        ignore_eos=True), use_tqdm=False, lora_request=[n and LoRARequest(n) for _, n in jobs])
    for (p, name), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(refs[name] if name else adapters[0], p, NEW), name
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_a_draft_model_drafts_with_its_adapter_of_the_requests_adapters_name(adapters):
    """A draft model (here the model itself) given the same adapters by name drafts what the model with its
    adapter decodes: every draft is accepted; given none, it drafts with the base model for every request, and
    the model's adapter rows reject some. The tokens are peft's either way."""
    model, path, dirs, refs = adapters
    prompts = prompts_of([6, 9])
    jobs = [(p, name) for p in prompts for name in ("a", "b")]
    rates = {}
    for with_adapters in (True, False):
        spec = {"model": str(path), "num_speculative_tokens": 3}
        if with_adapters:
            spec["lora_modules"] = [f"{n}={p}" for n, p in dirs.items()]
        llm = _engine(path, dirs, max_loras=2, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], SamplingParams(
            temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False,
            lora_request=[LoRARequest(n) for _, n in jobs])
        for (p, name), out in zip(jobs, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(refs[name], p, NEW), (with_adapters, name)
        stats = llm.engine.speculator.stats
        assert stats.num_draft_tokens > 0
        rates[with_adapters] = stats.acceptance_rate
        llm.engine.check_no_leaks()
    assert rates[True] == 1.0 and rates[False] < 0.9, rates


def test_an_adapters_logits_are_peft_logits(adapters):
    """The next-token distribution after a prompt, chunked over 8-token steps: within fp32 rounding of
    transformers + peft's."""
    model, path, dirs, refs = adapters
    prompt = prompts_of([37])[0]
    llm = _engine(path, dirs, max_num_batched_tokens=8, max_prefill_tokens_with_decodes=8)
    for name in ("a", "b"):
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                           use_tqdm=False, lora_request=LoRARequest(name))[0]
        got = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
        with torch.no_grad():
            ref = torch.log_softmax(refs[name](torch.tensor([prompt])).logits[0, -1].float(), -1)
        for t, lp in got.items():
            assert abs(lp - float(ref[t])) < 1e-4, (name, t, lp, float(ref[t]))


def test_a_gguf_lora_file_of_llama_cpps_converter_runs_as_its_peft_source(adapters):
    """tests/data/lora_llama_a.gguf is adapter "a" as llama.cpp's convert_lora_to_gguf.py wrote it
    (benchmarks/tools/record_gguf_lora.sh: its Q and K rows in llama.cpp's rotary order, alpha as a key):
    loaded beside the PEFT directory, both give transformers + peft's tokens."""
    from pathlib import Path

    import gguf

    model, path, dirs, refs = adapters
    recorded = Path(__file__).parent / "data" / "lora_llama_a.gguf"
    up_a = next(t for t in gguf.GGUFReader(recorded).tensors if t.name == "blk.0.ffn_up.weight.lora_a")
    peft_a = refs["a"].base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight
    assert torch.equal(torch.from_numpy(up_a.data.copy()), peft_a.detach()), \
        "the recorded file is another adapter's: record it again"
    prompts = prompts_of([9, 30])
    want = [hf_greedy(refs["a"], p, NEW) for p in prompts]
    llm = _engine(path, {"a": dirs["a"], "gguf": recorded})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for name in ("a", "gguf"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=LoRARequest(name))
        assert [list(o.outputs[0].token_ids) for o in outs] == want, name


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(adapters):
    _, path, dirs, _ = adapters
    llm = _engine(path, dirs)
    prompt = {"prompt_token_ids": prompts_of([40])[0]}
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(name):
        return llm.generate(prompt, params, use_tqdm=False, lora_request=name and LoRARequest(name))[0].num_cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0 and cached(None) == 0  # blocks computed under "a" serve neither
    assert cached("a") == 32 and cached("b") == 32 and cached(None) == 32


def test_unload_and_load_again(adapters):
    model, path, dirs, refs = adapters
    llm = _engine(path, dirs)
    prompt = prompts_of([9])[0]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = hf_greedy(refs["a"], prompt, NEW)
    run = lambda lora: list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,  # noqa: E731
                                         lora_request=lora)[0].outputs[0].token_ids)
    assert run(LoRARequest("a")) == want
    llm.engine.lora.unload("a")
    with pytest.raises(RequestError, match="no LoRA adapter named 'a' is loaded; loaded: b"):
        run(LoRARequest("a"))
    assert run(LoRARequest("again", lora_path=dirs["a"])) == want  # loaded by the request that names its path
    assert sorted(llm.engine.lora.names()) == ["again", "b"]


def test_what_cannot_run_is_refused(adapters, tiny_models, tmp_path):
    model, path, dirs, _ = adapters
    with pytest.raises(ConfigurationError, match="lora_modules needs enable_lora"):
        LLM(str(path), device="cpu", lora_modules=[f"a={dirs['a']}"])
    with pytest.raises(ConfigurationError, match="rank 8 is above --max-lora-rank 4"):
        _engine(path, dirs, max_lora_rank=4)
    make_adapter(model, tmp_path / "head", 3, 4, ["q_proj", "lm_head"])
    with pytest.raises(ConfigurationError, match=r"target modules \['lm_head'\] are not supported"):
        _engine(path, {"head": tmp_path / "head"})
    qwen2, _ = tiny_models["qwen2"]  # another base model's shapes (hidden size 96, not 64)
    make_adapter(qwen2, tmp_path / "other", 4, 4, ["q_proj"])
    with pytest.raises(ConfigurationError, match="an adapter of another base model"):
        _engine(path, {"other": tmp_path / "other"})
    llm = LLM(str(path), device="cpu", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(RequestError, match="start it with enable_lora"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False, lora_request=LoRARequest("a"))


def test_a_server_serves_adapters_by_model_name_and_loads_them_at_run_time(adapters):
    """Through the official client: an adapter named as the model (its reply names it too) computes what
    the offline engine computes with it, the base model beside it; /v1/models lists adapters with their
    parent; vLLM's load and unload routes add and remove one (a bad one is a 400, an unknown name a 404)."""
    import httpx
    import openai
    from live_server import in_process

    from pocketllm.config import EngineArgs
    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.server.api_server import create_app
    from pocketllm.server.async_llm import AsyncLLM
    from pocketllm.server.config import ServerConfig

    _, path, dirs, refs = adapters
    prompt = prompts_of([11])[0]
    want = {name: hf_greedy(ref, prompt, NEW) for name, ref in refs.items()}
    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", max_model_len=128, num_kv_blocks=64, enable_lora=True,
                                  max_loras=2, lora_modules=[f"a={dirs['a']}"]))
    with in_process(create_app(AsyncLLM(engine), ServerConfig(model_name="base"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def complete(model):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.model, list(r.choices[0].token_ids)

        assert complete("a") == ("a", want["a"])
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "a"} and models["a"].parent == "base"
        with pytest.raises(openai.NotFoundError, match="serves `base`, `a`"):
            complete("b")
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": dirs["b"]})
        assert r.status_code == 200, r.text
        assert complete("b") == ("b", want["b"])
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(path)})
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("a")
        assert complete("b") == ("b", want["b"]) and complete("base")[0] == "base"


def test_the_cpus_one_call_decoder_adds_the_adapters_as_the_layers_do(adapters, tmp_path):
    """A GGUF base (Q8_0) on the CPU's fast path, whose decode steps run every layer in one C call: with
    adapter rows in them (two adapters and the base model, mixed with prompt chunks), the tokens and
    logprobs are those of the layers' own modules, which add the adapters in torch."""
    from pocketllm.loaders.gguf_writer import write_gguf

    _, path, dirs, _ = adapters
    gguf = write_gguf(path, tmp_path / "q8.gguf", "Q8_0").path
    prompts = prompts_of([5, 23, 40, 12])
    jobs = [(p, name) for p in prompts for name in ("a", None, "b")]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)
    runs = []
    for one_call in (True, False):
        llm = LLM(str(gguf), device="cpu", max_model_len=128, num_kv_blocks=64, enable_lora=True, max_loras=2,
                  lora_modules=[f"{n}={p}" for n, p in dirs.items()], max_num_batched_tokens=24,
                  max_prefill_tokens_with_decodes=16)
        model = llm.engine.runner.model
        if one_call:
            assert model._decoder() is not None, "the fast path's one-call decoder covers this model"
        else:
            model._decoder = lambda: None
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], params, use_tqdm=False,
                            lora_request=[name and LoRARequest(name) for _, name in jobs])
        runs.append(outs)
    for (p, name), one, mods in zip(jobs, *runs):
        assert one.outputs[0].token_ids == mods.outputs[0].token_ids, (name, len(p))
        for a, b in zip(one.outputs[0].logprobs, mods.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_the_command_line_takes_vllms_lora_flags(adapters):
    from pocketllm.cli.args import engine_args_from
    from pocketllm.cli.main import build_parser

    _, path, dirs, _ = adapters
    argv = ["serve", str(path), "--enable-lora", "--lora-modules", f"a={dirs['a']}", f"b={dirs['b']}",
            "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4"]
    args = engine_args_from(build_parser(argv).parse_args(argv))
    assert args.enable_lora and args.lora_paths == dirs and (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (2, 8, 4)


def test_a_server_of_several_models_serves_a_loaded_models_adapters(adapters):
    """The multi-model router: a model's adapters are listed (with their parent) and answer by name once the
    model is loaded."""
    import dataclasses

    import httpx
    from live_server import in_process

    from pocketllm.config import EngineArgs
    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.server.config import ServerConfig, ServerState
    from pocketllm.server.guard import RequestGuard
    from pocketllm.server.router import ModelRouter, ModelSpec

    _, path, dirs, refs = adapters
    prompt = prompts_of([7])[0]
    args = EngineArgs(model=str(path), device="cpu", max_model_len=128, num_kv_blocks=64, enable_lora=True,
                      lora_modules=[f"a={dirs['a']}"])
    specs = [ModelSpec("base", args), ModelSpec("other", dataclasses.replace(args, enable_lora=False, lora_modules=None))]
    router = ModelRouter(specs, ServerConfig(model_name="base"), ServerState(), LLMEngine)
    with in_process(RequestGuard(router, router.cfg, router.state)) as url:
        def listed():
            return [(m["id"], m["parent"]) for m in httpx.get(f"{url}/v1/models").json()["data"]]

        assert listed() == [("base", None), ("other", None)]  # (nothing loaded yet)
        assert httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 2},
                          timeout=60).status_code == 200
        assert listed() == [("base", None), ("a", "base"), ("other", None)]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "a", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert r["model"] == "a" and r["choices"][0]["token_ids"] == hf_greedy(refs["a"], prompt, NEW)
        assert httpx.get(f"{url}/v1/models/a").json()["parent"] == "base"


def test_embeddings_of_an_adapter_named_as_the_model(adapters):
    """Task embed: /v1/embeddings naming an adapter pools the adapter's hidden states (transformers + peft's
    last token, final norm), offline and through the server alike; the base model's differ."""
    import openai
    from live_server import in_process

    from pocketllm.config import EngineArgs
    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.server.api_server import create_app
    from pocketllm.server.async_llm import AsyncLLM
    from pocketllm.server.config import ServerConfig

    model, path, dirs, refs = adapters
    prompt = prompts_of([13])[0]
    with torch.no_grad():
        want = {name: m.base_model.model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
                for name, m in refs.items()}
        want[None] = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]

    def close(got, name):
        return float(torch.nn.functional.cosine_similarity(torch.tensor(got), want[name], dim=0)) > 0.99999

    kw = dict(device="cpu", max_model_len=128, num_kv_blocks=64, task="embed", enable_lora=True, max_loras=2,
              lora_modules=[f"{n}={p}" for n, p in dirs.items()])
    offline = LLM(str(path), **kw)
    for name in ("a", "b", None):
        got = offline.embed({"prompt_token_ids": prompt}, use_tqdm=False, lora_request=name and LoRARequest(name))
        assert close(got[0].embedding, name), name
    engine = LLMEngine(EngineArgs(model=str(path), **kw))
    with in_process(create_app(AsyncLLM(engine), ServerConfig(model_name="base"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for name in ("a", "b"):
            r = client.embeddings.create(model=name, input=[prompt], encoding_format="float")
            assert r.model == name and close(r.data[0].embedding, name) and not close(r.data[0].embedding, None)
