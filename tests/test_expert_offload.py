"""Experts in host memory (`cpu_offload_experts`, llama.cpp's --n-cpu-moe): the GPU's kernels run the
model (interpreted here on CPU tensors, as tests/test_moe.py runs them) while the experts of the first
N layers are built for the CPU and run on its kernels. The routing is the GPU's; the greedy tokens are
the resident model's; the memory plan leaves those experts out of the device's bytes; what cannot be
offloaded is refused before loading."""
from __future__ import annotations

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


def _run(path, offload, prompts):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, exact_kernels=True,
              cpu_offload_experts=offload)
    with captured_logits(llm) as logits:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs], torch.cat(logits)


# The GPU's kernels on CPU tensors run under Triton's interpreter, which only a machine without CUDA uses
# (conftest): on a CUDA machine test_on_cuda_offloaded_experts_give_the_resident_tokens runs them for real.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")


@interpreted
def test_offloaded_experts_compute_what_resident_experts_compute(mixtral_q8, monkeypatch):
    from pocketllm.kernels import platform
    from pocketllm.kernels.triton import gguf as kg

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})  # the GPU's kernels, on CPU tensors
    tuned = kg.kernel_config  # 16-row tiles: fewer programs for the interpreter
    monkeypatch.setattr(kg, "kernel_config", lambda regime, qtype: {**tuned(regime, qtype), "BLOCK_N": 16})
    prompts = prompts_of([3, 9])
    resident, tokens, logits = _run(mixtral_q8, None, prompts)
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
    assert resident.engine.planned_weight_bytes - llm.engine.planned_weight_bytes == experts


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_on_cuda_offloaded_experts_give_the_resident_tokens(tiny_models, mixtral_q8, kind):
    path = mixtral_q8 if kind == "gguf" else tiny_models["mixtral"][1]
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 11, 17])]
    tokens = {}
    for offload in (None, "1", "all"):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=64, num_kv_blocks=16,
                  cpu_offload_experts=offload)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens[offload] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert tokens["1"] == tokens[None] and tokens["all"] == tokens[None]
