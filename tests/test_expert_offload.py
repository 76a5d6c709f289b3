"""Experts in host memory (`cpu_offload_experts`, llama.cpp's --n-cpu-moe): the GPU's kernels run the
model (interpreted here on CPU tensors, as tests/test_moe.py runs them) while the experts of the first
N layers are built for the CPU and run on its kernels. The routing is the GPU's; the greedy tokens are
the resident model's; the memory plan leaves those experts out of the device's bytes; what cannot be
offloaded is refused before loading."""
from __future__ import annotations

import collections
import types

import gguf
import pytest
import torch
from conftest import prompts_of
from reference import captured_logits

from pocketllm import LLM, SamplingParams
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.layers.moe import SparseMoE


@pytest.fixture
def mixtral_q8(tiny_models, tmp_path_factory):
    from pocketllm.loaders.gguf_writer import write_gguf

    return write_gguf(tiny_models["mixtral"][1], tmp_path_factory.mktemp("offload") / "mixtral.Q8_0.gguf", "Q8_0").path


def _run(path, offload, prompts, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, exact_kernels=True,
              cpu_offload_experts=offload, **kw)
    with captured_logits(llm) as logits:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs], torch.cat(logits)


# The GPU's kernels on CPU tensors run under Triton's interpreter, which only a machine without CUDA uses
# (conftest): on a CUDA machine test_on_cuda_offloaded_experts_give_the_resident_tokens runs them for real.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")


def _gpu_kernels_on_cpu(monkeypatch):
    from pocketllm.kernels import platform
    from pocketllm.kernels.triton import gguf as kg

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})  # the GPU's kernels, on CPU tensors
    tuned = kg.kernel_config  # 16-row tiles: fewer programs for the interpreter
    monkeypatch.setattr(kg, "kernel_config", lambda regime, qtype: {**tuned(regime, qtype), "BLOCK_N": 16})


PROMPTS = prompts_of([3, 9])


@pytest.fixture(scope="module")
def resident_runs(tiny_models, tmp_path_factory):
    """kind -> (planned weight bytes, greedy tokens, logits) of the resident model on PROMPTS (the GPU's kernels)."""
    from pocketllm.loaders.gguf_writer import write_gguf

    q8 = write_gguf(tiny_models["mixtral"][1], tmp_path_factory.mktemp("resident") / "mixtral.Q8_0.gguf", "Q8_0").path
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        _gpu_kernels_on_cpu(mp)
        for kind, path in (("gguf", q8), ("safetensors", tiny_models["mixtral"][1])):
            llm, tokens, logits = _run(path, None, PROMPTS)
            runs[kind] = (llm.engine.planned_weight_bytes, tokens, logits)
    return runs


@interpreted
def test_offloaded_experts_compute_what_resident_experts_compute(mixtral_q8, resident_runs, monkeypatch):
    _gpu_kernels_on_cpu(monkeypatch)
    planned, tokens, logits = resident_runs["gguf"]
    prompts = PROMPTS
    # the first layer's experts in host memory, the second's resident: both kinds in one model
    llm, got_tokens, got_logits = _run(mixtral_q8, "1", prompts)
    blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers]
    assert [moe.on_host for moe in blocks] == [True] + [False] * (len(blocks) - 1)
    for moe in blocks:
        assert isinstance(moe, SparseMoE) and moe.kernels.gpu  # the router: the GPU's
        assert (moe.stacks is None) == moe.on_host and moe.experts[0].kernels.gpu != moe.on_host
        paths = {lin.quantized.path for e in moe.experts for lin in (e.gate_up_proj, e.down_proj)}
        assert paths == ({"c"} if moe.on_host else {"triton"})  # host bytes never reach a Triton launch
    assert got_tokens == tokens
    assert float((got_logits - logits).abs().max()) < 1e-4 * float(logits.abs().max())
    # the plan before loading leaves the offloaded experts' bytes out of the device's
    experts = sum(int(t.n_bytes) for t in gguf.GGUFReader(mixtral_q8).tensors if t.name.startswith("blk.0.ffn_")
                  and "_exps" in t.name)
    assert planned - llm.engine.planned_weight_bytes == experts


@interpreted
@pytest.mark.parametrize("kind", ["safetensors"])  # (GGUF blocks copy as rows alike: the CUDA test runs both)
def test_experts_copied_to_the_device_as_selected_compute_what_resident_experts_compute(tiny_models, mixtral_q8,
                                                                                      resident_runs, monkeypatch, kind):
    """expert_offload copy with two slots a layer (a token's two experts): decode steps evict and copy, a prompt's
    chunk selects more experts than there are slots and runs in rounds; the device holds two experts' worth."""
    _gpu_kernels_on_cpu(monkeypatch)
    path = mixtral_q8 if kind == "gguf" else tiny_models["mixtral"][1]
    planned, tokens, logits = resident_runs[kind]
    llm, got_tokens, got_logits = _run(path, "all", PROMPTS, expert_offload="copy", expert_cache_slots=2)
    blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers]
    for moe in blocks:
        cache = moe.cache
        assert not moe.on_host and cache.slots == 2 and len(moe.experts) > 2
        assert all(part.stacked.shape[0] == 2 * host.shape[1] for part, host in zip(cache.parts, cache.host))
        assert cache.copied > 2 and cache.hits > 0, (cache.copied, cache.hits)  # evicted and copied again; reused
    assert got_tokens == tokens
    assert float((got_logits - logits).abs().max()) < 1e-4 * float(logits.abs().max())
    # the plan: each layer's experts on the device for two slots of the layer's experts
    experts = sum(p.numel() for moe in blocks for p in moe.experts.parameters()) * 4 if kind == "safetensors" else \
        sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)
    share = 1 - 2 / len(blocks[0].experts)
    assert abs(planned - llm.engine.planned_weight_bytes - share * experts) <= 1


def test_the_expert_slots_keep_the_experts_the_router_selects_most():
    """Four slots; experts 0 and 1 selected at most steps, the others in turn, once each. The hot pair is
    copied once and stays (the recency order alone would push expert 1 out while the others pass); the counts
    halve as HALF_LIFE selections pass, so a change of traffic moves the set."""
    from pocketllm.layers import expert_cache
    from pocketllm.layers.expert_cache import ExpertCache

    weights = torch.arange(16 * 3 * 4, dtype=torch.float32).reshape(16 * 3, 4)  # 16 experts of 3 rows
    part = types.SimpleNamespace(stacked=weights.clone(), bias=None, rehome=lambda t: None)  # (an ExpertStack's part)
    cache = ExpertCache([types.SimpleNamespace(parts=[part], bias=None)], 16, 4, torch.device("cpu"))
    copies = collections.Counter()
    fetch = cache.fetch

    def counted(experts):
        before = dict(cache.resident)
        fetch(experts)
        copies.update(e for e in experts if e not in before)

    cache.fetch = counted
    ran = []
    stacked = lambda x, w, ids, slots, n, grouped_max: ran.append(slots.tolist()) or x  # noqa: E731
    for step in range(48):
        if step == 6:  # (by now the hot pair has been selected more often than any other)
            copies.clear()
        cold = 2 + step % 14
        ids = torch.tensor([[0, cold]] if step % 3 else [[1, cold]])
        cache.run(torch.zeros(1, 4), torch.ones(1, 2), ids, stacked)
        for e, slot in cache.resident.items():  # each resident expert's rows are in its slot
            assert torch.equal(part.stacked[slot * 3:slot * 3 + 3], weights[e * 3:e * 3 + 3])
    assert copies[0] == copies[1] == 0 and {0, 1} <= set(cache.resident)
    assert sum(copies.values()) >= 40  # the cold ones come and go
    # The traffic moves to experts 8-11, 20 selections each: fewer than expert 0's 32, so without the halving
    # expert 0 would stay for good; with it, the old counts fade and the four new experts hold the slots.
    expert_cache.HALF_LIFE = 16
    try:
        for step in range(40):
            cache.run(torch.zeros(1, 4), torch.ones(1, 2), torch.tensor([[8, 9]] if step % 2 else [[10, 11]]), stacked)
    finally:
        expert_cache.HALF_LIFE = 4096
    assert set(cache.resident) == {8, 9, 10, 11}


def test_what_cannot_be_offloaded_is_refused_before_loading(tiny_models, mixtral_q8, monkeypatch):
    with pytest.raises(UnsupportedFeatureError, match="the cpu platform holds every weight in host memory already"):
        LLM(str(mixtral_q8), device="cpu", cpu_offload_experts="all")
    from pocketllm.kernels import platform

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})
    with pytest.raises(UnsupportedFeatureError, match="has no mixture-of-experts layers"):
        LLM(str(tiny_models["llama"][1]), device="cpu", cpu_offload_experts="1")
    layers = len(gguf.GGUFReader(mixtral_q8).fields) and sum(
        t.name.endswith("ffn_gate_inp.weight") for t in gguf.GGUFReader(mixtral_q8).tensors)
    with pytest.raises(ConfigurationError, match=f"the model has {layers} layers of experts; give at most {layers}"):
        LLM(str(mixtral_q8), device="cpu", cpu_offload_experts=str(layers + 1))
    with pytest.raises(ConfigurationError, match="cpu_offload_experts must be a number of layers or 'all'"):
        LLM(str(mixtral_q8), device="cpu", cpu_offload_experts="half")
    with pytest.raises(ConfigurationError, match="expert_offload must be compute or copy"):
        LLM(str(mixtral_q8), device="cpu", cpu_offload_experts="1", expert_offload="stream")
    with pytest.raises(ConfigurationError, match="are for experts offloaded with cpu_offload_experts"):
        LLM(str(mixtral_q8), device="cpu", expert_offload="copy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_on_cuda_offloaded_experts_give_the_resident_tokens(tiny_models, mixtral_q8, kind):
    path = mixtral_q8 if kind == "gguf" else tiny_models["mixtral"][1]
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 11, 17])]
    tokens = {}
    for offload, mode in ((None, "compute"), ("1", "compute"), ("all", "compute"), ("all", "copy")):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=64, num_kv_blocks=16,
                  cpu_offload_experts=offload, expert_offload=mode, expert_cache_slots=2 if mode == "copy" else None)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens[offload, mode] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert tokens["1", "compute"] == tokens["all", "compute"] == tokens["all", "copy"] == tokens[None, "compute"]
