"""The CPU fast path for GGUF weights (`exact_kernels=False`): integer dot products over
activations quantized to 8 bits per block of 32. Checked against the exact dequantized matmul
(gguf's dequantizer) on the same activations rounded as the kernel rounds them, against the
float result within the rounding's bound, and on the default model against the exact path."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from fixtures import default_model_gguf
from pocketllm import LLM, SamplingParams
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.quant.quantize import quantize
from pocketllm.quant.linear import GGUFLinear

INT8_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
if not all(gguf_ops.supports_int8(t) for t in INT8_TYPES):  # a CPU without VNNI keeps the exact kernels
    pytest.skip("this CPU has no VNNI: the fast path is not built", allow_module_level=True)


def quantized_weights(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF rows [n, row bytes], gguf's dequantized weights [n, k] float64)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = torch.from_numpy(quantize(w, qtype, search=False)).view(torch.uint8).reshape(n, -1).contiguous()
    return raw, torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(n, k).double()


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32, int8 codes (round half to even) times amax / 127."""
    b, k = x.shape
    blocks = x.reshape(b, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(b, k)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 8, 19])
@pytest.mark.parametrize("k", [64, 576])
def test_int8_gemm_equals_the_exact_product_of_rounded_activations(qtype, batch, k):
    raw, w = quantized_weights(qtype, 40, k)
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch + k))
    x[0, :32] = 0.0  # an all-zero block has scale 0
    y = gguf_ops.gemm(x, gguf_ops.row_pointers([raw]), qtype, int8=True).double()
    exact_on_rounded = rounded_activations(x).double() @ w.T
    scale = (x.abs().double() @ w.abs().T)  # what float rounding is relative to
    assert torch.all((y - exact_on_rounded).abs() <= 1e-5 * scale + 1e-6)
    # Against the float product: each activation moves by at most half a step of its block's scale.
    step = (x.reshape(batch, -1, 32).abs().amax(-1) / 127.0).repeat_interleave(32, dim=1).double()
    bound = (step / 2) @ w.abs().T
    assert torch.all((y - x.double() @ w.T).abs() <= bound * 1.0001 + 1e-6)


def test_types_without_integer_kernels_keep_the_exact_path():
    raw, w = quantized_weights(T.Q4_K, 16, 256)
    fast = GGUFLinear.from_gguf(raw, T.Q4_K, 16, 256, int8_activations=True)
    assert fast.path == "c" and not fast.int8
    x = torch.randn(2, 256)
    torch.testing.assert_close(fast(x).double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)
    assert GGUFLinear.from_gguf(*quantized_weights(T.Q8_0, 16, 256)[:1], T.Q8_0, 16, 256, int8_activations=True).int8


def test_the_default_model_on_the_fast_path_agrees_with_the_exact_one():
    """Teacher-forced over real text (this repository's README, ~800 tokens): top-1 agreement and
    the KL divergence of the fast path from the exact one, over each position's top 20 tokens with
    the rest pooled (a coarse-grained KL, at most the full one; 97.1% and 0.0015 nats measured)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()[:2400]
    args = dict(max_model_len=1024, num_kv_blocks=128, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0)
    runs = {}
    for exact in (True, False):
        llm = LLM(str(default_model_gguf()), exact_kernels=exact, **args)
        runs[exact] = llm.generate(text, params)[0].prompt_logprobs[1:]
        del llm
    exact, fast = runs[True], runs[False]
    assert len(exact) == len(fast) > 400

    def top1(entry):
        return next(t for t, lp in entry.items() if lp.rank == 1)

    def kl(a, b) -> float:
        pa = {t: math.exp(lp.logprob) for t, lp in a.items()}
        pb = {t: math.exp(lp.logprob) for t, lp in b.items()}
        common = [t for t in pa if t in pb]
        rest_a = max(1e-12, 1 - sum(pa[t] for t in common))
        rest_b = max(1e-12, 1 - sum(pb[t] for t in common))
        return sum(pa[t] * math.log(pa[t] / pb[t]) for t in common) + rest_a * math.log(rest_a / rest_b)

    agree = sum(top1(a) == top1(b) for a, b in zip(exact, fast)) / len(exact)
    mean_kl = sum(kl(a, b) for a, b in zip(exact, fast)) / len(exact)
    assert agree >= 0.95 and mean_kl <= 0.01, (agree, mean_kl)
