"""Mixture-of-experts runtimes (Qwen3-MoE, Mixtral, gpt-oss) beyond the shared parity suite
(test_parity runs them against transformers like every tiny model): GGUF round trips, which experts
a step runs, and what is refused before loading."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import prompts_of
from reference import captured_logits, hf_greedy, hf_last_logits

from pocketllm import LLM, SamplingParams
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.moe import SparseMoE

MOE = ["qwen3_moe", "mixtral"]


def _last_logits(path, prompts):
    llm = LLM(str(path), dtype="float32", exact_kernels=True)
    with captured_logits(llm) as captured:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    return llm, captured[0]


@pytest.mark.parametrize("kind", MOE)
def test_gguf_f32_equals_transformers(kind, tiny_models, tmp_path):
    """The stacked expert tensors (blk.N.ffn_*_exps) and the router (ffn_gate_inp) written and read
    back: F32 files give transformers' logits and greedy tokens."""
    from pocketllm.loaders.gguf_writer import write_gguf

    model, src = tiny_models[kind]
    path = write_gguf(src, tmp_path / f"{kind}.F32.gguf", "F32").path
    prompts = prompts_of([1, 9, 30])
    llm, rows = _last_logits(path, prompts)
    assert type(llm.engine.runner.model).__name__ == model.config.architectures[0]
    for prompt, row in zip(prompts, rows):
        assert float((row - hf_last_logits(model, prompt)).abs().max()) < 1e-4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 24) for p in prompts]


@pytest.mark.parametrize("kind", MOE + ["gpt_oss"])
def test_gguf_q8_0_round_trip_stays_close(kind, tiny_models, tmp_path):
    """`quantize` to Q8_0 (the experts quantized as stacked [experts, rows, cols] tensors; rows that
    do not fit 32-blocks fall back as llama-quantize does): it loads, experts kept quantized, and
    the logits stay within a few percent of transformers'."""
    import gguf

    from pocketllm.loaders.gguf_writer import write_gguf

    model, src = _gpt_oss_at_limit_7(tiny_models, tmp_path) if kind == "gpt_oss" else tiny_models[kind]
    path = write_gguf(src, tmp_path / f"{kind}.Q8_0.gguf", "Q8_0").path
    types = {t.name.split(".", 2)[2]: t.tensor_type.name for t in gguf.GGUFReader(path).tensors
             if t.name.startswith("blk.0.")}
    assert types["ffn_gate_exps.weight"] == "Q8_0" and types["ffn_gate_inp.weight"] == "F32"
    prompts = prompts_of([4, 21])
    llm, rows = _last_logits(path, prompts)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts[0].gate_up_proj.quantized is not None
    for prompt, row in zip(prompts, rows):
        ref = hf_last_logits(model, prompt)
        assert float((row - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_a_step_runs_only_the_selected_experts(tiny_models):
    """Each expert runs once per layer and step, on exactly the tokens that selected it; experts no
    token selected do not run."""
    _, src = tiny_models["mixtral"]
    llm = LLM(str(src), dtype="float32", exact_kernels=True)
    moe = llm.engine.runner.model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    routed, calls = [], {}
    moe.register_forward_pre_hook(lambda m, args: routed.append(m.route(args[0])[1]))
    for e, expert in enumerate(moe.experts):
        expert.register_forward_pre_hook(lambda m, args, e=e: calls.setdefault(len(routed), []).append(
            (e, args[0].shape[0])))
    llm.generate([{"prompt_token_ids": p} for p in prompts_of([3, 11])],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(routed) == 4  # one prefill step, three decode steps
    for step, ids in enumerate(routed, start=1):
        counts = torch.bincount(ids.flatten(), minlength=len(moe.experts))
        assert calls[step] == [(e, int(n)) for e, n in enumerate(counts.tolist()) if n]


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_grouped_expert_path_equals_the_sorted_path(kind, tiny_models, tmp_path, monkeypatch):
    """Experts on the Triton kernels (interpreted here) are stacked after loading, one copy, and
    steps of up to GROUPED_MAX_TOKENS tokens multiply every (token, expert) pair in one launch
    (what the CUDA graphs capture), steps of FUSED_MIN_TOKENS or more (4 here) sorted by expert on
    the device into the tile kernel, the experts' outputs summed by one kernel (gpt-oss's down
    projection biases added there): the same greedy tokens as the sorted path on the C kernels,
    logits within float32 rounding."""
    from pocketllm.kernels import platform
    from pocketllm.kernels.triton import gguf as kg
    from pocketllm.kernels.triton import moe as tmoe
    from pocketllm.loaders.gguf_writer import write_gguf

    src = _gpt_oss_at_limit_7(tiny_models, tmp_path)[1] if kind == "gpt_oss" else tiny_models[kind][1]
    path = write_gguf(src, tmp_path / f"{kind}.Q8_0.gguf", "Q8_0").path
    tuned = kg.kernel_config  # 16-row tiles: fewer programs for the interpreter
    monkeypatch.setattr(kg, "kernel_config", lambda regime, qtype: {**tuned(regime, qtype), "BLOCK_N": 16})
    monkeypatch.setattr(tmoe, "FUSED_MIN_TOKENS", {"gguf": 4, "dense": 4})
    prompts = prompts_of([3, 7])
    kernels = []  # which expert kernel each projection ran: the 10-token prefill fused, decodes grouped
    for mod, name, tag in ((tmoe, "fused_moe", "fused"), (kg, "gguf_grouped_gemv", "grouped")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _t=tag, **kw: kernels.append(_t) or _f(*a, **kw))
    runs = {}
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(platform, "TRITON_DEVICES", devices)
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, exact_kernels=True)
        moe = llm.engine.runner.model.model.layers[0].mlp
        grouped = "cpu" in devices
        assert (moe.stacks is not None) == grouped
        if grouped:
            (gate_up,) = moe.stacks[0].parts  # Q8_0 gate and up: one part
            assert moe.experts[1].gate_up_proj.quantized._store.data_ptr() == gate_up.stacked[gate_up.n].data_ptr()
            sorted_calls = []
            moe.experts[0].register_forward_pre_hook(lambda m, a: sorted_calls.append(1))
        with captured_logits(llm) as logits:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        if grouped:
            assert not sorted_calls
            layers = len(llm.engine.runner.model.model.layers)
            assert kernels == ["fused"] * 2 * layers + ["grouped"] * 2 * layers * 2, kernels
        runs[grouped] = ([o.outputs[0].token_ids for o in outs], torch.cat(logits))
    (tokens_s, logits_s), (tokens_g, logits_g) = runs[False], runs[True]
    assert tokens_g == tokens_s
    assert float((logits_g - logits_s).abs().max()) < 1e-4 * float(logits_s.abs().max())


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])  # (qwen3_moe's tiny experts are 48 wide: not Q8_0)
def test_one_call_experts_equal_the_module_loop(kind, tiny_models, tmp_path):
    """On the CPU fast path a one-token step runs its selected experts in one C call
    (DecodeExperts: gate/up with biases, SiLU or the clamped SwiGLU, down, the weighted sum): the
    same greedy tokens as the experts' modules in turn, logits within float32 rounding."""
    from pocketllm.loaders.gguf_writer import write_gguf

    src = _gpt_oss_at_limit_7(tiny_models, tmp_path)[1] if kind == "gpt_oss" else tiny_models[kind][1]
    llm = LLM(str(write_gguf(src, tmp_path / f"{kind}.Q8_0.gguf", "Q8_0").path), max_model_len=64,
              num_kv_blocks=16, enable_prefix_caching=False)  # the same steps twice
    model = llm.engine.runner.model
    model._cpu_decoder = False  # (the module forward: Mixtral's whole decode step is otherwise one call)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    prompts = prompts_of([3, 11])
    runs = []
    for one_call in (True, False):
        for moe in blocks:
            moe._cpu_experts = None if one_call else False  # None: built at the first one-token step
        with captured_logits(llm) as logits:
            outs = [llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                    for p in prompts]  # one sequence a step: the one-token path
        runs.append(([o[0].outputs[0].token_ids for o in outs], torch.cat(logits)))
        assert all(bool(moe._cpu_experts) == one_call for moe in blocks)
    (tokens, logits), (want_tokens, want_logits) = runs
    assert tokens == want_tokens
    assert float((logits - want_logits).abs().max()) <= 1e-4 * float(want_logits.abs().max())


def _copy_with_config(src, dst, **changes):
    """A copy of the checkpoint ``src`` at ``dst`` whose config.json has ``changes``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_mixtral_with_a_sliding_window_is_refused_before_loading(tiny_models, tmp_path):
    path = _copy_with_config(tiny_models["mixtral"][1], tmp_path / "mixtral-swa", sliding_window=16)
    with pytest.raises(UnsupportedFeatureError, match="attention kind 'sliding_window'.*supported: full"):
        LLM(str(path), dtype="float32")


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> OpenAI's MXFP4 (blocks [..., rows, cols / 32, 16] uint8, E8M0
    exponents [..., rows, cols / 32] uint8): each 32-block scaled so its largest magnitude fits 6,
    every value rounded to the nearest FP4 code; weights 2b and 2b + 1 in byte b, low nibble first."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - _FP4).abs().argmin(-1) | ((x < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_equal_transformers_dequantization(tiny_models, tmp_path):
    """A gpt-oss checkpoint whose experts are in OpenAI's MXFP4 layout (as released): the blocks stay
    quantized (GGUF MXFP4) and the model computes what transformers computes with the weights its
    own MXFP4 decoder (`convert_moe_packed_tensors`) makes of the same bytes."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, src = tiny_models["gpt_oss"]
    path = tmp_path / "gpt-oss-mxfp4"
    path.mkdir()
    state = load_file(src / "model.safetensors")
    reference = transformers.GptOssForCausalLM(model.config).eval()
    ref_state = dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(state.pop(name).transpose(1, 2).float())  # x @ W -> rows = out
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        ref_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # x @ W again
    reference.load_state_dict(ref_state)
    save_file(state, str(path / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))

    prompts = prompts_of([1, 9, 30])
    llm, rows = _last_logits(path, prompts)
    expert = llm.engine.runner.model.model.layers[0].mlp.experts[0]
    assert expert.gate_up_proj.quantized.qtype.name == "MXFP4"
    for prompt, row in zip(prompts, rows):
        assert float((row - hf_last_logits(reference, prompt)).abs().max()) < 1e-4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 16) for p in prompts]


def test_checkpoints_of_other_quantization_methods_are_refused_before_loading(tiny_models, tmp_path):
    """A Hugging Face quantization method a runtime does not declare (AWQ here) is refused by name,
    with what is supported, before any tensor is read."""
    _, src = tiny_models["llama"]
    path = tmp_path / "llama-awq"
    path.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedFeatureError, match="quantization type 'AWQ'; supported: BF16, F16, F32"):
        LLM(str(path), dtype="float32")


@pytest.mark.parametrize("shape,billions", [("qwen3-30b-a3b", 30.5), ("mixtral-8x7b", 46.7), ("gpt-oss-20b", 20.9)])
def test_named_shapes_build_the_published_parameter_counts(shape, billions):
    """The runtimes of the named MoE shapes (random-weight benchmarks: `--load-format dummy`),
    built on the meta device: the published total parameter counts."""
    from pocketllm.config import EngineArgs, ModelConfig
    from pocketllm.core.shapes import SHAPES
    from pocketllm.models.registry import select_runtime

    cfg = ModelConfig.from_hf_dict(SHAPES[shape])
    runtime = select_runtime(cfg, EngineArgs.from_kwargs(model=shape, load_format="dummy"), "cpu", "bfloat16")
    model = runtime.model_class(cfg, dtype=torch.bfloat16, device="meta", max_model_len=256)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == billions


def _gpt_oss_at_limit_7(tiny_models, tmp_path):
    """The tiny gpt-oss with GGUF's fixed SwiGLU limit, 7.0: (its transformers model, checkpoint)."""
    import transformers

    model, src = tiny_models["gpt_oss"]
    ckpt = _copy_with_config(src, tmp_path / "gpt-oss-7", swiglu_limit=7.0)
    reference = transformers.GptOssForCausalLM(transformers.GptOssConfig.from_pretrained(ckpt)).eval()
    reference.load_state_dict(model.state_dict())
    return reference, ckpt


def test_gpt_oss_gguf_equals_transformers(tiny_models, tmp_path):
    """gpt-oss written to GGUF as llama.cpp's converter lays it out (gate/up de-interleaved into
    ffn_gate_exps / ffn_up_exps, expert biases, attn_sinks, post_attention_norm) and read back:
    transformers' logits. GGUF fixes the SwiGLU limit at gpt-oss's 7.0, so the tiny model is
    rebuilt with it; a file of another limit is refused."""
    from pocketllm.loaders.gguf_writer import write_gguf

    _, src = tiny_models["gpt_oss"]
    with pytest.raises(UnsupportedFeatureError, match="swiglu_limit 7.0"):
        write_gguf(src, tmp_path / "refused.gguf", "F32")
    reference, ckpt = _gpt_oss_at_limit_7(tiny_models, tmp_path)
    path = write_gguf(ckpt, tmp_path / "gpt-oss.F32.gguf", "F32").path
    prompts = prompts_of([1, 9, 30])
    llm, rows = _last_logits(path, prompts)
    assert type(llm.engine.runner.model).__name__ == "GptOssForCausalLM"
    for prompt, row in zip(prompts, rows):
        assert float((row - hf_last_logits(reference, prompt)).abs().max()) < 1e-4
