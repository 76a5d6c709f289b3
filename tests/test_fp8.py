"""Block-scaled FP8 checkpoints (DeepSeek-V3's and Qwen3's FP8 releases): our quantizer writes transformers'
bytes and scales, our dequantization is transformers' to the bit, and an FP8 checkpoint our `quantize` wrote
runs as transformers runs it (its FP8 loader, dequantizing) on the CPU; other fp8 forms are refused."""
from __future__ import annotations

import json
import types

import pytest
import torch
import transformers
from conftest import prompts_of
from reference import hf_greedy, hf_last_logits
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

from pocketllm import LLM, SamplingParams
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.fp8_writer import write_checkpoint
from pocketllm.quant.fp8 import FP8, Fp8Blocks

BLOCKS = Fp8Blocks(128, 128)


@pytest.mark.parametrize("shape", [(256, 384), (384, 128)])
def test_quantize_writes_transformers_bytes(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    w[:128, :128] = 0  # a zero tile keeps scale 1
    ref = Fp8Quantize(types.SimpleNamespace(quantization_config=transformers.FineGrainedFP8Config()))
    want = ref._quantize_one("x.weight", w)
    values, scales = BLOCKS.quantize(w)
    assert values.dtype == FP8 and torch.equal(values.view(torch.uint8), want["x.weight"].view(torch.uint8))
    assert torch.equal(scales, want["x.weight_scale_inv"])


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (576, 64)])  # tiles cut at the edges too
def test_dequantize_is_transformers_to_the_bit(shape):
    torch.manual_seed(1)
    values = (torch.randn(shape) * 100).clamp(-448, 448).to(FP8)
    scales = torch.rand(BLOCKS.scale_shape(*shape)) * 1e-3
    want = _dequantize_fp8_weight(values, scales, [128, 128], torch.float32)
    assert torch.equal(BLOCKS.dequantize(values, scales, torch.float32), want)
    # bfloat16: that float32 weight rounded once (transformers rounds the scale to bfloat16 first)
    assert torch.equal(BLOCKS.dequantize(values, scales, torch.bfloat16), want.to(torch.bfloat16))


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def fp8_model(request, tiny_models, tmp_path_factory):
    """A tiny model's FP8 copy (its projections in tiles of 128: one tile, cut, per matrix) and transformers'
    model of it, read by transformers' FP8 loader."""
    _, path = tiny_models[request.param]
    out = write_checkpoint(path, tmp_path_factory.mktemp("fp8") / request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
    return out, ref


def test_the_checkpoint_holds_fp8_projections(fp8_model):
    out, _ = fp8_model
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    fp8 = {n for n, d in dtypes.items() if d == FP8}
    assert fp8 and all(n.endswith("_proj.weight") and n + "_scale_inv" in dtypes for n in fp8)
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) or "norm" in n or n.endswith("mlp.gate.weight")
                   for n in fp8)


def test_fp8_checkpoint_runs_as_transformers_runs_it(fp8_model):
    out, ref = fp8_model
    prompts = prompts_of([3, 17, 40])
    llm = LLM(str(out), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48, exact_kernels=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 16) for p in prompts]
    for p, o in zip(prompts, outs):  # the first token's top 5
        want = torch.log_softmax(hf_last_logits(ref, p), -1)
        for token, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - float(want[token])) < 1e-4


ON_GPU_KERNELS = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_GPU_KERNELS), pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("m", [1, 20, 70])  # each row count's tiles (kernels/triton/fp8.py `tiles`)
def test_the_fp8_kernel_multiplies_by_the_dequantized_weight(m, device):
    """Tiles cut at the edges of the weight and of its 128 x 128 scale tiles: in float32 the product of the
    dequantized weight within float32 rounding; in bfloat16 (CUDA) close to it."""
    from pocketllm.kernels.triton.fp8 import fp8_matmul

    torch.manual_seed(2)
    n, k = 200, 300
    values = (torch.randn(n, k) * 100).clamp(-448, 448).to(FP8)
    scales = torch.rand(BLOCKS.scale_shape(n, k)) * 1e-3
    x, bias = torch.randn(m, k), torch.randn(n)
    want = x @ BLOCKS.dequantize(values, scales, torch.float32).T + bias
    dev = torch.device(device)
    got = fp8_matmul(x.to(dev), values.to(dev), scales.to(dev), (128, 128), bias.to(dev)).cpu()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    if device == "cuda":
        half = fp8_matmul(x.to(dev, torch.bfloat16), values.to(dev), scales.to(dev), (128, 128)).float().cpu()
        assert float((half + bias - want).abs().max()) < 2e-2 * float(want.abs().max())


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_decode_rows_take_the_fp8_gemv_and_agree_with_the_tiles(dtype):
    """1-8 rows on the CUDA C GEMV (dense_gemv.cu with FP8=1; `fp8_matmul` sends it FP8_GEMV_MAX_M) against
    float32 products of the dequantized weight, rows past a multiple of the block's four and scale tiles cut
    at the edge, bias added; and each row within bfloat16 rounding of the same row in a 16-row product of
    Triton's tiles."""
    from pocketllm.kernels.cuda import dense_gemv
    from pocketllm.kernels.triton.fp8 import fp8_tiled

    torch.manual_seed(3)
    for n, k in [(202, 304), (1024, 4096)]:
        values = (torch.randn(n, k) * 100).clamp(-448, 448).to(FP8)
        scales = torch.rand(BLOCKS.scale_shape(n, k)) * 1e-3
        dev = torch.device("cuda")
        x = torch.randn(16, k).to(dtype)
        bias = torch.randn(n).to(dtype)
        want = x.float() @ BLOCKS.dequantize(values, scales, torch.float32).T + bias.float()
        args = values.to(dev), scales.to(dev), (128, 128), bias.to(dev)
        tiled = fp8_tiled(x.to(dev), values.to(dev), scales.to(dev), (128, 128), bias.to(dev)).float().cpu()
        scale = float(want.abs().max())
        for m in range(1, dense_gemv.MAX_ROWS + 1):
            assert dense_gemv.fp8_usable(x[:m].to(dev), values.to(dev), scales.to(dev), (128, 128))
            got = dense_gemv.fp8_linear(x[:m].to(dev), *args).float().cpu()
            assert float((got - want[:m]).abs().max()) < 1e-2 * scale, (n, k, m)
            assert float((got - tiled[:m]).abs().max()) < 1e-2 * scale, (n, k, m)


@CUDA
def test_on_cuda_fp8_weights_are_kept_and_run_as_transformers_runs_them(fp8_model):
    from pocketllm.quant.fp8 import Fp8Linear

    out, ref = fp8_model
    prompts = prompts_of([3, 17])
    llm = LLM(str(out), device="cuda", dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert any(isinstance(m, Fp8Linear) for m in llm.engine.runner.model.modules())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]


@ON_GPU_KERNELS
def test_the_gpus_kernels_keep_the_fp8_weights_and_run_as_transformers_runs_them(fp8_model, monkeypatch):
    """The GPU's kernels (Triton's interpreter on CPU tensors) keep each projection's FP8 values and scales as
    the checkpoint holds them and multiply them there (kernels/triton/fp8.py), DeepSeek's shared experts too;
    the routed experts, the router and MLA's kv_b_proj (read as numbers) are dequantized. The memory plan
    counts a byte a kept weight."""
    from pocketllm.kernels import platform
    from pocketllm.layers.linear import ConcatLinear, Linear
    from pocketllm.layers.moe import SparseMoE
    from pocketllm.quant.fp8 import Fp8Linear
    from pocketllm.runner.memory import weight_bytes

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})
    out, ref = fp8_model
    prompts = prompts_of([3, 17])
    llm = LLM(str(out), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in (*moe.experts.modules(),
                                                                                         moe.gate)}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    kept = [n for n, m in linears if isinstance(m.quantized, (Fp8Linear, ConcatLinear))]
    assert kept and all(n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_a_proj", "q_b_proj",
                                    "q_proj", "kv_a_proj_with_mqa")) for n in kept), kept
    assert all(m.weight is not None for n, m in linears if id(m) in experts or n.endswith("kv_b_proj"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]
    # --dequantize-at-load: the GPU's kernels on dequantized weights (the way back, should the FP8 path not serve)
    undone = LLM(str(out), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, dequantize_at_load=True)
    assert not any(isinstance(m, Fp8Linear) for m in undone.engine.runner.model.modules())
    # what keeping them saves, planned and held, against the same model dequantized (the CPU's exact kernels)
    cpu = torch.device("cpu")
    monkeypatch.undo()
    dense = LLM(str(out), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, exact_kernels=True)
    saved = weight_bytes(dense.engine.runner.model, cpu) - weight_bytes(model, cpu)
    planned = dense.engine.planned_weight_bytes - llm.engine.planned_weight_bytes
    assert saved > 0 and abs(planned - saved) <= 0.02 * saved, (planned, saved)


@pytest.mark.parametrize("config, says", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "scaled per tensor"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static activation"),
    ({"quant_method": "awq", "bits": 4}, "quantization type 'AWQ'"),
])
def test_other_quantized_checkpoints_are_refused_before_loading(tiny_models, tmp_path, config, says):
    import shutil

    _, path = tiny_models["qwen3_moe"]
    copy = shutil.copytree(path, tmp_path / "q")
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(UnsupportedFeatureError, match=says):
        LLM(str(copy), device="cpu", dtype="float32", max_model_len=128)


def test_quantize_command_writes_an_fp8_checkpoint(tiny_models, tmp_path, capsys):
    from pocketllm.cli.main import main

    _, path = tiny_models["qwen3_moe"]
    assert main(["quantize", str(path), str(tmp_path / "fp8"), "--type", "FP8", "-q"]) == 0
    assert "block-scaled FP8" in capsys.readouterr().out
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert Fp8Blocks.of(config) == BLOCKS
    out = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", max_model_len=64).generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
