"""The CPU fast path for GGUF weights (`exact_kernels=False`): integer dot products over
activations quantized to 8 bits (per block of 32 for the 32-element types, per super-block of 256
for the k-quants and IQ4_XS). Every type and every instruction-set build this CPU can run is
checked against the exact dequantized matmul (gguf's dequantizer) on the same activations rounded
as the kernel rounds them, and against the float result within the rounding's bound; on the
default model, the whole fast path against the exact one."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from fixtures import default_model_gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

from pocketllm import LLM, SamplingParams
from pocketllm.core.gguf_types import row_nbytes as raw_row_bytes
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.kernels.cpu.build import _arch_flags, compiler, load_cpu_kernels
from pocketllm.kernels.dispatch import int8_passes
from pocketllm.quant.linear import GGUFLinear
from pocketllm.quant.quantize import quantize

LATTICE_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
INT8_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS,
              *LATTICE_TYPES]
SUPER_BLOCK_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, *LATTICE_TYPES}  # activations per 256
if compiler() is None or not _arch_flags("avx2"):  # a CPU without AVX2 keeps the exact kernels
    pytest.skip("no C compiler, or this CPU has no AVX2: the fast path is not built", allow_module_level=True)
assert all(gguf_ops.supports_int8(t) for t in INT8_TYPES), "the CPU kernels did not build (see the log)"


def _distinct_builds(isas: list[str]) -> list[str]:
    """The levels whose builds differ on this CPU, each once (the lower ones are what CPUs without AVX-512, VNNI or a
    fast pdep get: code paths of their own)."""
    builds: dict[tuple, str] = {}
    for isa in isas:
        builds.setdefault(tuple(_arch_flags(isa)), isa)
    return list(builds.values())


ISAS = _distinct_builds(["native", "avx2", "avx2-bmi2", "avx2-vnni"])
# Interleaved eight rows at a time: the 32-element types wherever the fast path is built, Q4_K, and
# Q6_K, Q2_K and Q3_K too with AVX-512 VNNI.
X8_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.IQ4_NL, T.MXFP4, T.Q4_K, T.Q6_K, T.Q2_K, T.Q3_K]
# a row's super-block there (the interleaved test's docstring says why)
X8_SUPER_BYTES = {T.Q4_K: 148, T.Q6_K: 214, T.Q2_K: 84, T.Q3_K: 118}


def has_x8(qtype, isa: str = "native") -> bool:
    return bool(load_cpu_kernels(isa).gguf_x8_supported(int(qtype)))


X8_BUILDS = [(isa, t) for isa in ISAS for t in X8_TYPES if has_x8(t, isa)]


def quantized_weights(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF rows [n, row bytes], gguf's dequantized weights [n, k] float64): gaussian weights
    quantized, or for the IQ4 types and MXFP4 (which this package does not quantize) random codes
    under random scales, and for the lattice types dummy-gguf's random blocks (every grid entry and
    sign pattern, scales across their range)."""
    rng = np.random.default_rng(seed)
    if qtype in LATTICE_TYPES:
        from pocketllm.loaders.dummy_gguf import _random_blocks

        blocks = _random_blocks(rng, qtype, (n, k), 0.05)
    elif qtype in (T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
        if qtype == T.MXFP4:  # E8M0 exponents: weights up to 12 * 2**-11, as the other types' scales give
            blocks[:, 0] = rng.integers(112, 118, len(blocks), dtype=np.uint8)
            blocks[:4, 0] = [0, 1, 2, 3]  # E8M0's subnormal halves (2**-128, 2**-127) and the smallest normal ones
        else:
            blocks[:, :2] = rng.uniform(0.0005, 0.002, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    else:
        blocks = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype, search=False)
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(n, -1).contiguous()
    return raw, torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(n, k).double()


def activation_block(qtype) -> int:
    return 256 if qtype in SUPER_BLOCK_TYPES else 32


def rounded_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel sees it: per block, int8 codes (round half to even) times amax / 127."""
    b, k = x.shape
    blocks = x.reshape(b, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(b, k)


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qtype) -> None:
    """y (the kernel's x @ w.T) is the exact product of x rounded as the kernel rounds it (up to
    float rounding), and within that rounding's bound of the float product."""
    blk = activation_block(qtype)
    exact_on_rounded = rounded_activations(x, blk).double() @ w.T
    scale = (x.abs().double() @ w.abs().T)  # what float rounding is relative to
    assert torch.all((y - exact_on_rounded).abs() <= 1e-5 * scale + 1e-6)
    # Against the float product: each activation moves by at most half a step of its block's scale.
    step = (x.reshape(x.shape[0], -1, blk).abs().amax(-1) / 127.0).repeat_interleave(blk, dim=1).double()
    bound = (step / 2) @ w.abs().T
    assert torch.all((y - x.double() @ w.T).abs() <= bound * 1.0001 + 1e-6)


def activations(batch: int, k: int, qtype) -> torch.Tensor:
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch + k))
    x[0, :activation_block(qtype)] = 0.0  # an all-zero block has scale 0
    x[-1, -1] = 40.0  # an outlier: its block's other values keep few levels
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 8, 19])
def test_int8_gemm_equals_the_exact_product_of_rounded_activations(isa, qtype, batch):
    k = 512 if qtype in SUPER_BLOCK_TYPES else 576
    raw, w = quantized_weights(qtype, 40, k)
    x = activations(batch, k, qtype)
    y = gguf_ops.gemm(x, gguf_ops.row_pointers([raw]), qtype, int8=True, lib=load_cpu_kernels(isa)).double()
    assert_within_rounding(y, x, w, qtype)


@pytest.mark.parametrize("isa,qtype", X8_BUILDS, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("batch", [1, 3, 8, 19])
def test_interleaved_rows_equal_the_exact_product_of_rounded_activations(isa, qtype, batch):
    """Repacked at load (eight rows' blocks side by side): the same products as the per-row
    kernels, over the same bytes (the 32-element types: the file's size; Q4_K: 148 bytes a row
    and super-block for 144, its 6-bit scales and minimums unpacked to bytes; Q6_K: 214 for 210,
    an integer constant of each row's super-block added; Q2_K: the file's 84, its scales reordered; Q3_K:
    118 for 110, its scales unpacked and a constant added)."""
    k = 512 if qtype in SUPER_BLOCK_TYPES else 576
    raw, w = quantized_weights(qtype, 48, k)
    x = activations(batch, k, qtype)
    rows = gguf_ops.row_pointers([raw])
    lib = load_cpu_kernels(isa)
    packed = gguf_ops.repack_x8(rows, qtype, k, lib=lib)
    if qtype in X8_SUPER_BYTES:
        assert packed.numel() == 48 * (k // 256) * X8_SUPER_BYTES[qtype]
    else:
        assert packed.numel() == raw.numel() and torch.equal(packed.sort().values, raw.reshape(-1).sort().values)
    y = gguf_ops.gemm_x8(x, packed, 48, qtype, lib=lib).double()
    assert_within_rounding(y, x, w, qtype)
    torch.testing.assert_close(y, gguf_ops.gemm(x, rows, qtype, int8=1, lib=lib).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3])
def test_heads_multiply_each_its_own_matrix(qtype, batch):
    """gguf_heads_gemm_int8 (MLA's absorbed heads: a deepseek2 file's attn_k_b, attn_v_b): head h's
    activations times the h-th block of rows, each the int8 product that one matrix alone gives."""
    heads, n = 3, 40
    k = activation_block(qtype) * 2
    raw, w = quantized_weights(qtype, heads * n, k)
    x = torch.randn(heads, batch, k, generator=torch.Generator().manual_seed(5))
    rows = gguf_ops.row_pointers([raw])
    y = gguf_ops.heads_gemm(x, rows, n, qtype, passes=1).double()
    for h in range(heads):
        own = slice(h * n, (h + 1) * n)
        assert_within_rounding(y[h], x[h], w[own], qtype)
        assert torch.equal(y[h], gguf_ops.gemm(x[h], rows[own], qtype, int8=1).double())


def test_layers_repack_where_the_kernels_cover_them():
    """A fast-path layer of a type this build interleaves repacks (its file rows are no longer held),
    the two-pass output layer too; rows not a multiple of 8 and other types keep the file's rows."""
    def layer(qtype, n, passes=1):
        raw, w = quantized_weights(qtype, n, 256)
        return GGUFLinear.from_gguf(raw, qtype, n, 256, int8_activations=passes), w
    x = torch.randn(3, 256)
    for qtype, n, passes, repacked in [(T.Q4_0, 24, 1, True), (T.Q8_0, 20, 1, False), (T.Q5_K, 24, 1, False),
                                       (T.Q8_0, 24, 2, True), (T.Q4_K, 24, 1, True), (T.Q6_K, 24, 1, True),
                                       (T.Q6_K, 24, 2, True)]:
        lin, w = layer(qtype, n, passes)
        repacked = repacked and has_x8(qtype)
        assert lin.fast_path_weights()[1] == repacked, (qtype, n, passes)
        assert lin.nbytes() == n * (X8_SUPER_BYTES[qtype] if repacked and qtype in X8_SUPER_BYTES
                                    else raw_row_bytes(qtype, 256))
        if passes == 1:
            assert_within_rounding(lin(x).double(), x, w, qtype)


@pytest.mark.parametrize("qtype,interleaved", [(T.Q4_1, False), (T.Q8_0, False), (T.Q4_K, False), (T.Q6_K, False),
                                               (T.Q4_1, True), (T.Q8_0, True), (T.Q6_K, True)], ids=str)
def test_a_second_pass_over_the_rounding_error(qtype, interleaved):
    """int8=2 (the output layer): the activations' rounding error is quantized too and multiplied
    as further rows: the exact product of x's two-pass rounding, and 100x closer to the float one."""
    if interleaved and not has_x8(qtype):
        pytest.skip(f"this CPU's build does not interleave {qtype.name} (AVX-512 VNNI does)")
    k = 512
    raw, w = quantized_weights(qtype, 40, k)
    rows = gguf_ops.row_pointers([raw])
    packed = gguf_ops.repack_x8(rows, qtype, k) if interleaved else None

    def gemm(x, passes):
        return (gguf_ops.gemm_x8(x, packed, 40, qtype, passes) if interleaved
                else gguf_ops.gemm(x, rows, qtype, int8=passes)).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    blk = activation_block(qtype)
    first = rounded_activations(x, blk)
    second = first + rounded_activations(x - first, blk)
    y = gemm(x, 2)
    exact = x.double() @ w.T
    scale = x.abs().double() @ w.abs().T
    assert torch.all((y - second.double() @ w.T).abs() <= 1e-5 * scale + 1e-6)
    assert (y - exact).abs().max() * 100 < (gemm(x, 1) - exact).abs().max()


@pytest.mark.parametrize("qtype", [t for t in X8_TYPES if has_x8(t)], ids=lambda t: t.name)
def test_embedding_rows_read_from_the_interleaved_layout(qtype):
    """A tied embedding table whose output layer repacked it: rows come back as gguf dequantizes
    them from the file's layout, bit for bit; ids out of range are refused."""
    raw, w = quantized_weights(qtype, 48, 256)
    lin = GGUFLinear.from_gguf(raw, qtype, 48, 256, int8_activations=2)
    assert lin.fast_path_weights()[1]
    ids = torch.tensor([[0, 47, 9], [8, 8, 31]])
    assert torch.equal(lin.embedding_rows(ids).double(), w[ids])
    with pytest.raises(IndexError):
        lin.embedding_rows(torch.tensor([48]))


def test_fused_parts_share_one_table():
    """QKV-style fusion: a row-pointer table over three parts is the concatenation of their products."""
    parts = [quantized_weights(T.Q4_K, n, 256, seed=i) for i, n in enumerate((32, 8, 8))]
    x = torch.randn(5, 256)
    fused = gguf_ops.gemm(x, gguf_ops.row_pointers([r for r, _ in parts]), T.Q4_K, int8=True)
    alone = torch.cat([gguf_ops.gemm(x, gguf_ops.row_pointers([r]), T.Q4_K, int8=True) for r, _ in parts], 1)
    assert torch.equal(fused, alone)


def test_the_default_model_on_the_fast_path_agrees_with_the_exact_one():
    """Teacher-forced over real text (this repository's README, its first 800 tokens): top-1 agreement and
    the KL divergence of the fast path from the exact one, over each position's top 20 tokens with
    the rest pooled (a coarse-grained KL, at most the full one). The full-vocabulary figures over
    4,000 tokens are benchmarks/suites/cpu_fast_path_accuracy.py's."""
    text = (Path(__file__).parents[1] / "README.md").read_text()[:2400]
    args = dict(max_model_len=1024, num_kv_blocks=128, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0)
    runs = {}
    for exact in (True, False):
        llm = LLM(str(default_model_gguf()), exact_kernels=exact, **args)
        model = llm.engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        # every matmul on the fast path, in two 8-bit passes: the model is small (hidden size 576)
        assert int8_passes(576) == 2 and int8_passes(1536) == 1
        assert {m.int8 for m in layers} == {0 if exact else 2}
        # where the head is repacked, the tied table is read from it: one copy of its bytes
        assert (model.model.embed_tokens.rows_from is model.lm_head.quantized) == (not exact and has_x8(T.Q8_0))
        ids = llm.get_tokenizer().encode(text)[:800]  # however the README's first screen reads
        runs[exact] = llm.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs[1:]
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
    assert agree >= 0.99 and mean_kl <= 1e-4, (agree, mean_kl)


def test_the_default_model_answers_on_the_fast_path_as_on_the_exact_one():
    """Default settings, greedy chat: the answers of the exact path (token-identical to transformers,
    tests/test_gguf_model.py), word for word; "What is the capital of France?" gets Paris and stops
    (with one 8-bit pass: "L'Étoile, la Cité, la France, la France, ..." to the length limit)."""
    questions = ["What is the capital of France?", "Who wrote Romeo and Juliet?", "Write a haiku about the sea.",
                 "List the first five prime numbers."]
    answers = {}
    for exact in (True, False):
        llm = LLM(str(default_model_gguf()), exact_kernels=exact, max_model_len=512, num_kv_blocks=64)
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in questions]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
        answers[exact] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        del llm
    assert answers[False] == answers[True]
    text, finish = answers[False][0]
    assert "Paris" in text and finish == "stop"
