"""Decode-only steps of the Llama family on the CPU fast path run all decoder layers in one C call
(kernels/cpu/llama_decode.c). The module-by-module forward on the same path is the reference: the
same kernels in the same order, so the same greedy tokens and the same logits up to float rounding
(the exact path is compared with transformers elsewhere)."""
from __future__ import annotations

import copy

import gguf
import pytest
import torch
from conftest import prompts_of
from reference import captured_logits
from tiny_models import make_llama256, make_model

from pocketllm import LLM, SamplingParams
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.kernels.cpu.build import compiler
from pocketllm.layers.linear import ConcatLinear
from pocketllm.loaders.gguf_writer import write_gguf

if compiler() is None:  # with one, the kernels must build: a build that fails fails these tests
    pytest.skip("no C compiler: the CPU kernels are not built", allow_module_level=True)
if not gguf_ops.supports_int8(gguf.GGMLQuantizationType.Q8_0):  # (the fast path's kernels: the call runs them)
    pytest.skip("this CPU has no 8-bit dot-product kernels (AVX2): no fast path, no one-call step",
                allow_module_level=True)


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory):
    """qwen2 with random q/k/v biases (transformers initializes them to 0) in Q8_0 and Q4_0; a llama
    with rows of 256 in Q4_K_M (Q4_K q/k with a Q6_K v: a fused projection of two types); qwen3
    (q/k norms); mixtral and qwen3-moe (mixtures of experts; qwen3-moe's experts 64 wide, to be Q8_0, and
    a dense layer among them); qwen3-moe's tiny config itself, whose experts' down projections, 48 wide,
    cannot be Q8_0 (32-value blocks) and stay float: off the fast path's kernels, not covered; DeepSeek V2 and
    V3 (latent attention, shared experts, grouped routing; V3's correction bias made random: transformers
    initializes it to 0), their widths multiples of 32."""
    root = tmp_path_factory.mktemp("decode")
    qwen2 = copy.deepcopy(tiny_models["qwen2"][0])
    with torch.no_grad():
        for name, p in qwen2.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    qwen2.save_pretrained(root / "qwen2", safe_serialization=True)
    return {
        "qwen2-Q8_0": write_gguf(root / "qwen2", root / "qwen2.Q8_0.gguf", "Q8_0").path,
        "qwen2-Q4_0": write_gguf(root / "qwen2", root / "qwen2.Q4_0.gguf", "Q4_0", pure=True).path,
        "llama256-Q4_K_M": write_gguf(make_llama256(root, num_layers=3)[1], root / "llama256.Q4_K_M.gguf",
                                      "Q4_K_M").path,
        "qwen3-Q8_0": write_gguf(tiny_models["qwen3"][1], root / "qwen3.Q8_0.gguf", "Q8_0").path,
        "mixtral-Q8_0": write_gguf(tiny_models["mixtral"][1], root / "mixtral.Q8_0.gguf", "Q8_0").path,
        "qwen3_moe-Q8_0": write_gguf(make_model("qwen3_moe", root, moe_intermediate_size=64)[1],
                                     root / "qwen3_moe.Q8_0.gguf", "Q8_0").path,
        "qwen3_moe48-Q8_0": write_gguf(tiny_models["qwen3_moe"][1], root / "qwen3_moe48.Q8_0.gguf", "Q8_0").path,
        **{f"{kind}-Q8_0": write_gguf(_deepseek(kind, root), root / f"{kind}.Q8_0.gguf", "Q8_0").path
           for kind in ("deepseek_v2", "deepseek_v3")},
    }


def _deepseek(kind: str, root):
    model, _ = make_model(kind, root / f"{kind}-made", kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(root / kind, safe_serialization=True)
    return root / kind


def generate(llm: LLM, prompts: list[list[int]], one_call: bool):
    model = llm.engine.runner.model
    model._cpu_decoder = None if one_call else False  # None: built at the first decode-only step
    with captured_logits(llm) as logits:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], logits, model._cpu_decoder


@pytest.mark.parametrize("kind", ["qwen2-Q8_0", "qwen2-Q4_0", "llama256-Q4_K_M", "qwen3-Q8_0"])
@pytest.mark.parametrize("lengths", [[9], [1, 7, 30, 65]], ids=["one", "four"])
def test_one_call_decode_equals_the_module_forward(files, kind, lengths):
    llm = LLM(str(files[kind]), max_model_len=128, num_kv_blocks=64, enable_prefix_caching=False)  # same steps twice
    prompts = prompts_of(lengths, seed=len(kind))
    tokens, logits, decoder = generate(llm, prompts, one_call=True)
    assert decoder, "the one-call step covers this model"
    want_tokens, want_logits, _ = generate(llm, prompts, one_call=False)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):  # (the one-prompt case's first step mixes a 1-token row in)
        assert float((got - want).abs().max()) <= 2e-4 * float(want.abs().max())
    if kind == "llama256-Q4_K_M":  # the case of a projection with parts of two types
        layers = llm.engine.runner.model.model.layers
        assert any(isinstance(layer.self_attn.qkv_proj.quantized, ConcatLinear) for layer in layers)


@pytest.mark.parametrize("kind", ["mixtral-Q8_0", "qwen3_moe-Q8_0", "deepseek_v2-Q8_0", "deepseek_v3-Q8_0"])
def test_a_mixture_of_experts_decodes_in_the_call(files, kind, monkeypatch):
    """Mixtures of experts whose blocks route as the call does (a softmax over all experts, the top k, renormalized;
    DeepSeek's groups, V3's sigmoid and correction bias, the scaling): their decode steps run in the one call
    (routing and experts in C: one row's experts in turn, several rows grouped by expert, the shared experts
    after them; DeepSeek's latent attention with the file's quantized heads), with the module forward's tokens
    and its logits up to float rounding."""
    from pocketllm.kernels.cpu.llama_decode import LlamaDecoder

    llm = LLM(str(files[kind]), max_model_len=128, num_kv_blocks=64, enable_prefix_caching=False)
    calls = []
    real = LlamaDecoder.__call__
    monkeypatch.setattr(LlamaDecoder, "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    for lengths in ([9], [5, 12, 20, 33]):
        prompts = prompts_of(lengths, seed=len(kind))
        calls.clear()
        tokens, logits, decoder = generate(llm, prompts, one_call=True)
        assert decoder and calls == [len(lengths)] * 11  # (after the prompts' step, every step)
        want_tokens, want_logits, _ = generate(llm, prompts, one_call=False)
        assert tokens == want_tokens and len(logits) == len(want_logits)
        for got, want in zip(logits, want_logits):
            assert float((got - want).abs().max()) <= 2e-4 * float(want.abs().max())


def test_models_it_does_not_cover_keep_the_module_forward(files):
    """Experts off the fast path's kernels (float down projections) and the exact path: no one-call step, the
    same tokens as ever."""
    prompts = prompts_of([5, 12])
    fast = LLM(str(files["qwen3_moe48-Q8_0"]), max_model_len=128, num_kv_blocks=64)
    tokens, _, decoder = generate(fast, prompts, one_call=True)
    assert decoder is False
    assert tokens == generate(fast, prompts, one_call=False)[0]
    exact = LLM(str(files["qwen2-Q8_0"]), max_model_len=128, num_kv_blocks=64, exact_kernels=True)
    assert generate(exact, prompts, one_call=True)[2] is None  # never built: not the fast path


def test_decode_rows_compute_the_same_bits_beside_a_prompt(files):
    """A step that decodes some requests and prefills another runs its decode rows in the one call too:
    a request's logits are the same bits whether or not other prompts shared its steps (and the mixed
    steps are not the modules' slower masked attention over every decode row)."""
    prompt, late = prompts_of([20, 40], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(files["qwen2-Q8_0"]), max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=16)
    engine = llm.engine
    with captured_logits(llm) as alone:
        llm.generate([{"prompt_token_ids": prompt}], params)
    with captured_logits(llm) as mixed:
        engine.add_request("a", {"prompt_token_ids": prompt}, params)
        for _ in range(4):  # its prompt (two steps), then two tokens
            engine.step()
        engine.add_request("b", {"prompt_token_ids": late}, params)  # 40 tokens: chunks beside a's rows
        steps = []
        while engine.has_unfinished_requests():
            engine.step()
            steps.append((engine.last_step.num_decodes, engine.last_step.num_tokens))
    assert any(0 < d < t - 1 for d, t in steps[:3]), steps  # a's rows shared steps with b's chunks
    a_rows = [x[0] for x in mixed[:2 + 10]]  # a's row comes first in every step (decode rows first)
    assert all(torch.equal(got, want[0]) for got, want in zip(a_rows[2:], alone[2:12])), "a's logits moved"
