"""The Triton GGUF kernels (pocketllm/kernels/triton/gguf.py) against dequant.py's exact weights.

On a GPU they run for real; on the CPU they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes.  Tolerances (u = 2**-24):

* float32 activations: |dy| <= 2*K*u * (|x| @ |W|.T) + 2*u*|x| @ |W|.T, two differently ordered
  float32 dot products of length K, plus one rounding of each weight (the GPU fuses the scale
  and the offset into one FMA: the weight may differ from dequant.py's by an ulp).
* bfloat16 activations: the dot and dequant regimes round each weight to bfloat16, every regime
  rounds the output (the interpreter truncates instead of rounding): |dy| <= 2**-7 * (|x| @ |W|.T).
"""
from __future__ import annotations

import os
import sys

import gguf
import numpy as np
import pytest
import torch
import triton
from test_quant_linear import realistic_blocks

from pocketllm.kernels import dispatch
from pocketllm.kernels.triton import gguf as kg
from pocketllm.kernels.triton.int8_act import quantize_activations
from pocketllm.quant.dequant import dequantize

T = gguf.GGMLQuantizationType
DEV = "cuda" if torch.cuda.is_available() else "cpu"
COVERED = sorted(kg.TRITON_GGUF_TYPES, key=lambda t: t.value)
U = 2.0 ** -24
N, K = 40, 512  # N: not a multiple of any tile; K: 2 super-blocks, 16 blocks of 32


def make(qtype, n=N, k=K, seed=0):
    raw = torch.from_numpy(realistic_blocks(np.random.default_rng(seed), qtype, n, k))
    return raw.to(DEV), dequantize(raw, qtype, (n, k)).to(DEV)


def check(y, x, w):
    x, ref = x.float(), x.float() @ w.T
    mag = x.abs() @ w.abs().T
    if y.dtype == torch.float32:
        tol = (2 * x.shape[1] + 2) * U * mag + 1e-30
    else:
        tol = 2.0 ** -7 * mag + 1e-30
    err = (y.float() - ref).abs()
    assert y.shape == ref.shape
    assert bool((err <= tol).all()), f"max err {err.max():.3g}, err/tol {(err / tol).max():.3g}"


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_matmul_matches_dequantized_weights(qtype):
    raw, w = make(qtype, seed=qtype.value)
    packed = kg.pack_gguf(raw, qtype, K)
    g = torch.Generator().manual_seed(qtype.value)
    for m in (1, 2, 3):  # gemv (one and two rows), then dequantize + matmul
        x = torch.randn(m, K, generator=g).to(DEV)
        check(kg.gguf_matmul(x, packed, qtype, K, packed=True), x, w)
    x = torch.randn(16, K, generator=g).to(DEV, torch.bfloat16)
    y = kg.gguf_matmul(x, raw, qtype, K)  # raw bytes: packed on the fly
    assert y.dtype == torch.bfloat16
    check(y, x, w)


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_dequantize_matches_dequant_py(qtype):
    raw, w = make(qtype, n=24, seed=50 + qtype.value)
    out = kg.gguf_dequantize(raw, qtype, K)
    if DEV == "cpu":  # the interpreter rounds as torch does: the same bits
        assert torch.equal(out, w)
    else:  # the GPU may fuse v * a + c into one FMA
        assert bool(((out - w).abs() <= 2 * U * w.abs().max()).all())
    half = kg.gguf_dequantize(raw, qtype, K, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, out.half())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.IQ2_XXS, T.IQ1_M, T.IQ3_S], ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(qtype):
    """An embedding table kept in its GGUF blocks: a lookup decodes just the rows it names."""
    from pocketllm.quant.linear import GGUFLinear

    raw, w = make(qtype, n=24, seed=90 + qtype.value)
    ids = torch.tensor([[3, 0, 23], [3, 17, 5]]).to(DEV)
    rows = kg.gguf_dequantize(raw, qtype, K, rows=ids)
    assert rows.shape == (2, 3, K)
    if DEV == "cpu":
        assert torch.equal(rows, w[ids])
    else:
        assert bool(((rows - w[ids]).abs() <= 2 * U * w.abs().max()).all())
    layer = GGUFLinear.from_gguf(raw.cpu(), qtype, 24, K, path="triton", device=DEV, dtype=torch.bfloat16)
    looked_up = layer.embedding_rows(ids)
    assert looked_up.dtype == torch.bfloat16  # rounded (the interpreter truncates): within a bf16 ulp
    assert bool(((looked_up.float() - rows).abs() <= 2.0 ** -7 * rows.abs()).all())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q5_0, T.IQ2_XS], ids=lambda t: t.name)
def test_every_regime_and_split(qtype, monkeypatch):
    # K = 3 super-blocks / 24 blocks: splits of unequal length; N = 24: a partial row tile
    n, k = 24, 768
    raw, w = make(qtype, n=n, k=k, seed=7)
    packed = kg.pack_gguf(raw, qtype, k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, k, generator=g).to(DEV)
    for regime, split in (("gemv", 1), ("gemv", 2), ("gemv", 3)):
        check(kg.gguf_matmul(x, packed, qtype, k, packed=True, regime=regime, split_k=split), x, w)
    check(kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="dequant"), x, w)
    monkeypatch.setattr(kg, "SCRATCH_ELEMS", 7 * k)  # decode 7 rows at a time: 4 slices
    check(kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="dequant"), x, w)
    xb = x.to(torch.bfloat16)
    check(kg.gguf_matmul(xb, packed, qtype, k, packed=True, regime="dequant"), xb, w)


@pytest.mark.parametrize("qtype", sorted(kg._mma().MMA_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_tensor_core_tile_kernel(qtype, monkeypatch):
    """The mma regime: tiles of 256 weights taken in parts, K split unevenly, partial row and
    activation tiles; Q8_0 and MXFP4 with a K that ends inside a step of eight blocks.  ``auto`` takes it for
    MMA_AUTO_TYPES and 16-bit activations from GEMV_MAX_M + 1 to MMA_MAX_M rows, not for float32."""
    n, k = (24, 768) if kg.block_size(qtype) == 256 else (24, 32 * 13)
    raw, w = make(qtype, n=n, k=k, seed=11)
    packed = kg.pack_gguf(raw, qtype, k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(17, k, generator=g).to(DEV)
    for part in (64, 256):
        monkeypatch.setitem(kg.MMA_CONFIG, "BLOCK_K", part)
        for split in (1, 2, 3):
            check(kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="mma", split_k=split), x, w)
            xb = x[:5].to(torch.bfloat16)
            check(kg.gguf_matmul(xb, packed, qtype, k, packed=True, regime="mma", split_k=split), xb, w)
    seen = []
    real = kg._mma().launch
    monkeypatch.setattr(kg._mma(), "launch", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    for m in (dispatch.GEMV_MAX_M, dispatch.GEMV_MAX_M + 1, dispatch.MMA_MAX_M, dispatch.MMA_MAX_M + 1):
        kg.gguf_matmul(torch.randn(m, k).to(DEV, torch.bfloat16), packed, qtype, k, packed=True)
    kg.gguf_matmul(x[:4], packed, qtype, k, packed=True)
    mmq = kg._mmq().usable(qtype, torch.device(DEV), k)  # the integer tensor-core kernel takes its rows first,
    x16 = mmq and kg._mmq().x16_ok(qtype)  # its bf16 variant those from MMQ_X16_MIN_M
    want = [m for m in (dispatch.GEMV_MAX_M + 1, dispatch.MMA_MAX_M) if not (mmq and m <= dispatch.MMQ_MAX_M)
            and not (x16 and dispatch.MMQ_X16_MIN_M <= m <= dispatch.MMQ_X16_MAX_M)]
    assert seen == (want if qtype in dispatch.MMA_AUTO_TYPES else [])


@pytest.mark.parametrize("qtype", sorted(kg._q8().Q8_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_int8_activation_gemv(qtype):
    """The 8-bit-activation GEMV computes exactly the product with the activations as quantized
    (integer sums; float32 rounding of the scaled sums only), and those are x to within their
    rounding; the auto regime takes it for bfloat16 decode rows, not for float32."""
    q8 = kg._q8()
    n, k = 24, 768
    raw, w = make(qtype, n=n, k=k, seed=20 + qtype.value)
    packed = kg.pack_gguf(raw, qtype, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(qtype.value)).to(DEV)
    xq, xd, xs = x8 = quantize_activations(x)
    xdeq = (xq.double().view(2, -1, 32) * xd.double()[..., None]).view(2, k)
    assert bool(((xdeq - x.double()).abs() <= xd.double().repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all())
    assert torch.allclose(xs.double(), xd.double() * xq.double().view(2, -1, 32).sum(-1))
    ref, mag = xdeq @ w.double().T, xdeq.abs() @ w.double().abs().T
    for split in (1, 3):
        y = q8.gemv_q8(x, packed, qtype, k, split_k=split)
        assert bool(((y.double() - ref).abs() <= 1e-6 * mag + 1e-30).all())
    assert torch.equal(y, q8.gemv_q8(x, packed, qtype, k, split_k=3, x8=x8))  # as its producer wrote them
    xb = x.bfloat16()
    y = kg.gguf_matmul(xb[:1], packed, qtype, k, packed=True)
    check(y, xb[:1], w)
    from pocketllm.kernels.cuda import gguf_gemv as cuda_gemv

    kernel = "cuda_gemv" if cuda_gemv.usable(qtype, xb.device) else "gemv_q8"  # the auto regime's
    assert torch.equal(y, kg.gguf_matmul(xb[:1], packed, qtype, k, packed=True, regime=kernel))
    assert not torch.equal(y, kg.gguf_matmul(xb[:1], packed, qtype, k, packed=True, regime="gemv"))
    exact = kg.gguf_matmul(x[:1], packed, qtype, k, packed=True)
    assert torch.equal(exact, kg.gguf_matmul(x[:1], packed, qtype, k, packed=True, regime="gemv"))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.MXFP4, T.IQ2_XXS], ids=lambda t: t.name)
def test_grouped_gemv_multiplies_each_pair_by_its_expert(qtype):
    """Mixture-of-experts products in one launch: row p is x[p // x_div] @ W[ids[p]].T for a stack
    of expert matrices (repeated and unused experts, both x_div of a layer), float32 activations
    on the exact kernel and bf16 ones (8-bit activations where the type has an int8 kernel)."""
    n, k, experts = 24, 512, 3
    raw, w = make(qtype, n=experts * n, k=k, seed=30 + qtype.value)
    stacked = kg.pack_gguf(raw, qtype, k)
    g = torch.Generator().manual_seed(qtype.value)
    ids = torch.tensor([2, 0, 2, 2, 0, 0]).to(DEV)  # three tokens, two experts each; expert 1 unused
    for x_div, rows, dtype in ((2, 3, torch.float32), (1, 6, torch.bfloat16)):
        xt = torch.randn(rows, k, generator=g).to(DEV, dtype)
        y = kg.gguf_grouped_gemv(xt, stacked, qtype, k, n, ids, x_div)
        assert y.shape == (6, n) and y.dtype == xt.dtype
        for p, e in enumerate(ids.tolist()):
            check(y[p:p + 1], xt[p // x_div:p // x_div + 1], w[e * n:(e + 1) * n])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4, None], ids=lambda t: t.name if t else "dense")
def test_fused_moe_multiplies_each_pair_by_its_expert(qtype, monkeypatch):
    """The expert-sorted tile kernel: pairs sorted by expert on the device (experts chosen by
    several tokens, by one, by none, and more pairs than a row block), each expert's pairs one tile;
    row p is x[p // x_div] @ W[ids[p]].T, in float32 within its rounding and in bfloat16."""
    from pocketllm.kernels.triton import moe

    monkeypatch.setattr(kg, "MMA_TYPE_CONFIG", {t: {"BLOCK_N": 16, "BLOCK_K": 64} for t in kg.MMA_TYPE_CONFIG})
    monkeypatch.setattr(kg, "MMA_CONFIG", {**kg.MMA_CONFIG, "BLOCK_N": 16, "BLOCK_K": 64})
    monkeypatch.setattr(moe, "FUSED_DENSE_CONFIG", {**moe.FUSED_DENSE_CONFIG, "BLOCK_N": 16, "BLOCK_K": 64})
    n, k, experts = 24, 512, 5
    g = torch.Generator().manual_seed(7)
    if qtype is None:
        w = torch.randn(experts * n, k, generator=g).to(DEV)
    else:
        raw, w = make(qtype, n=experts * n, k=k, seed=40 + qtype.value)
        stacked = kg.pack_gguf(raw, qtype, k)
    # 18 tokens, 2 experts each: experts 4 and 1 take 17 pairs each (two row blocks), 2 and 0 one, 3 none
    ids = torch.tensor([[4, 1]] * 17 + [[2, 0]]).to(DEV)
    routing = moe.align(ids, experts, block_m=16)
    assert routing.experts.tolist() == [0, 1, 1, 2, 4, 4, -1, -1]
    assert sorted(routing.pairs[routing.pairs < 36].tolist()) == list(range(36))
    monkeypatch.setattr(moe, "ONE_HOT_MAX", 0)  # the sorting branch (large steps) sorts the same
    by_sort = moe.align(ids, experts, block_m=16)
    assert torch.equal(by_sort.pairs, routing.pairs) and torch.equal(by_sort.experts, routing.experts)
    for x_div, rows, dtype in ((2, 18, torch.float32), (1, 36, torch.bfloat16)):
        xt = torch.randn(rows, k, generator=g).to(DEV, dtype)
        if qtype is None:
            stacked = w.to(xt.dtype)
        y = moe.fused_moe(xt, stacked, qtype, k, n, routing if xt.dtype == torch.float32 else by_sort, x_div)
        assert y.shape == (36, n) and y.dtype == xt.dtype
        for p, e in enumerate(ids.flatten().tolist()):
            we = stacked[e * n:(e + 1) * n].float() if qtype is None else w[e * n:(e + 1) * n]
            check(y[p:p + 1], xt[p // x_div:p // x_div + 1], we)


def test_grouped_dense_gemv():
    from pocketllm.kernels.triton.moe import grouped_dense_gemv

    g = torch.Generator().manual_seed(5)
    n, k = 40, 700  # neither a multiple of the tiles
    w = torch.randn(4 * n, k, generator=g).to(DEV)
    x = torch.randn(3, k, generator=g).to(DEV)
    ids = torch.tensor([3, 1, 3, 0, 1, 1]).to(DEV)
    y = grouped_dense_gemv(x, w, n, ids, x_div=2)
    ref = torch.stack([x[p // 2] @ w[e * n:(e + 1) * n].T for p, e in enumerate(ids.tolist())])
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_auto_regime_thresholds(monkeypatch):
    raw, w = make(T.Q4_K)
    packed = kg.pack_gguf(raw, T.Q4_K, K)
    seen = []
    real = kg._dequant_matmul
    monkeypatch.setattr(kg, "_dequant_matmul", lambda *a: seen.append("dequant") or real(*a))
    x = torch.randn(dispatch.GEMV_MAX_M + 1, K).to(DEV)
    check(kg.gguf_matmul(x, packed, T.Q4_K, K, packed=True), x, w)
    assert seen == ["dequant"]
    assert kg.gguf_matmul(x[:0], packed, T.Q4_K, K, packed=True).shape == (0, N)


def test_pack_keeps_the_bytes_and_the_size():
    raw, _ = make(T.Q6_K, n=8)
    packed = kg.pack_gguf(raw, T.Q6_K, K)  # 420-byte rows, padded to 432
    assert packed.shape == (8, 432) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, :420].flatten().sort().values, raw.flatten().sort().values)
    assert not packed[:, 420:].any()
    blocks = raw.view(8, 2, 210)
    assert torch.equal(packed[:, :192], blocks[:, 0, :192])  # first block's codes first
    assert torch.equal(packed[:, 384:402], blocks[:, 0, 192:])  # its scales and d after the codes


_ALIGN_KS = {32: (32, 96, 160, 256, 768, 4096), 256: (256, 768, 1280, 4096, 14336)}


@pytest.mark.parametrize("qtype", COVERED, ids=lambda t: t.name)
def test_packed_layout_is_16_byte_aligned(qtype):
    """Every packed row, body region and header region starts 16-byte aligned (the kernels load
    bodies as 16-byte vectors, and Triton assumes 16-divisible row sizes aligned), for any K."""
    for k in _ALIGN_KS[kg.block_size(qtype)]:
        n_blocks, hdr_start, targs = kg.type_args(qtype, k)
        prb = kg.packed_row_nbytes(qtype, k)
        assert prb % 16 == 0 and 0 <= prb - gguf.quants.GGML_QUANT_SIZES[qtype][1] * n_blocks < 16
        assert targs["BB"] % 16 == 0 and hdr_start % 16 == 0  # every block's body, the headers
        raw, w = make(qtype, n=3, k=k, seed=k)
        packed = kg.pack_gguf(raw, qtype, k)
        assert packed.shape == (3, prb) and packed.data_ptr() % 16 == 0
        assert packed.stride(0) % 16 == 0
        if k <= 768:
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEV)
            check(kg.gguf_matmul(x, packed, qtype, k, packed=True), x, w)
    with pytest.raises(ValueError, match="packed rows"):
        kg.gguf_matmul(torch.zeros(1, k).to(DEV), packed[:, :-16].contiguous(), qtype, k, packed=True)


def test_refuses_what_it_does_not_cover():
    raw, _ = make(T.Q4_K)
    with pytest.raises(ValueError, match="no Triton GGUF kernel for F16"):
        kg.gguf_matmul(torch.zeros(1, K), raw, T.F16, K)
    with pytest.raises(ValueError, match="take 288 bytes"):
        kg.gguf_matmul(torch.zeros(1, K), raw[:, :100].contiguous(), T.Q4_K, K)
    with pytest.raises(ValueError, match="x must be"):
        kg.gguf_matmul(torch.zeros(1, K + 1), raw, T.Q4_K, K)


# ---- the layers: GGUFLinear's "triton" path, fused shards, the engine ---------------------------

def test_capabilities_declare_the_kernel_types():
    from pocketllm.models.capabilities import CHECKPOINT_QUANTS, CUDA_KERNEL_TYPES, GGUF_TYPES, PLATFORMS

    assert {t.name for t in kg.TRITON_GGUF_TYPES} == CUDA_KERNEL_TYPES == PLATFORMS["cuda"].kept_quantized
    assert PLATFORMS["cuda"].quantizations == GGUF_TYPES | CHECKPOINT_QUANTS  # the rest load dequantized


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.IQ4_NL], ids=lambda t: t.name)
def test_gguf_linear_triton_path(qtype):
    from pocketllm.quant.linear import GGUFLinear

    raw, w = make(qtype, seed=3)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(DEV)
    layer = GGUFLinear.from_gguf(raw.cpu(), qtype, N, K, bias=bias, path="triton", device=DEV)
    assert layer.path == "triton" and layer.nbytes() == raw.numel() + 4 * N  # the GGUF size
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(1)).to(DEV)
    y = layer(x)
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    check(y.reshape(6, N) - bias, x.reshape(6, K), w)


def test_fused_shards_of_mixed_types(monkeypatch):
    """Q4_K_M's qkv: Q4_K q and k with a Q6_K v become one layer per type; same-type shards fuse."""
    from pocketllm.kernels import platform
    from pocketllm.layers.linear import ConcatLinear, Linear, QuantizedTensor

    monkeypatch.setattr(platform, "TRITON_DEVICES", {"cuda", "cpu"})  # the interpreter on the CPU
    sizes, qtypes = [32, 16, 16], [T.Q4_K, T.Q4_K, T.Q6_K]
    parts = [make(qt, n=sz, seed=i) for i, (sz, qt) in enumerate(zip(sizes, qtypes))]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).to(DEV)
    for types in (qtypes, [T.Q4_K] * 3):
        lin = Linear(K, sizes, device=DEV)
        for i, ((raw, _), qt) in enumerate(zip(parts, types)):
            raw = raw if qt == qtypes[i] else make(qt, n=sizes[i], seed=i)[0]
            lin.load(QuantizedTensor(raw.cpu(), qt, (sizes[i], K)), shard=i)
        q = lin.quantized
        if types == qtypes:
            assert isinstance(q, ConcatLinear) and [p.path for p in q.parts] == ["triton"] * 3
            w = torch.cat([p[1] for p in parts])
        else:
            assert q.path == "triton"
            w = torch.cat([make(T.Q4_K, n=sz, seed=i)[1] for i, sz in enumerate(sizes)])
        check(lin(x), x, w)


def test_engine_runs_the_triton_path_under_the_interpreter(tmp_path, monkeypatch):
    """A one-layer Q4_K_M model (random blocks) through the whole engine, every projection on the
    Triton kernels (interpreted): the same greedy tokens as the C kernels, logits within float32
    rounding."""
    from conftest import prompts_of
    from reference import captured_logits

    from pocketllm import LLM, SamplingParams
    from pocketllm.kernels import platform
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf
    from pocketllm.quant import linear as qlinear

    if DEV != "cpu":
        pytest.skip("the GPU tests below run the real thing")
    shape = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    path = write_dummy_gguf(tmp_path / "tiny.gguf", shape, "Q4_K_M", std=0.05).path
    prompts = prompts_of([6, 2], seed=3, vocab=320)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # The interpreter runs programs one by one: tiles of 16 rows keep the engine run short (the
    # tuned tiles, 1-2 rows, are checked by the kernel tests above).
    tuned = kg.kernel_config
    monkeypatch.setattr(kg, "kernel_config", lambda regime, qtype: {**tuned(regime, qtype), "BLOCK_N": 16})
    runs = {}
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(platform, "TRITON_DEVICES", devices)
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, exact_kernels=True)
        paths = {m.path for m in llm.engine.runner.model.modules() if isinstance(m, qlinear.GGUFLinear)}
        assert paths == ({"triton"} if "cpu" in devices else {"c"})
        with captured_logits(llm) as logits:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[len(devices)] = ([o.outputs[0].token_ids for o in outs], torch.cat(logits))
    (tokens_c, logits_c), (tokens_t, logits_t) = runs[1], runs[2]
    assert tokens_t == tokens_c
    assert torch.isfinite(logits_t).all()
    assert float((logits_t - logits_c).abs().max()) < 1e-4 * float(logits_c.abs().max())


# ---- on the GPU ---------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_model_sized_shapes_on_the_gpu(qtype):
    """Real tile counts: split-K for a 1024-row matrix, every regime, bf16 and fp16."""
    n, k = 1024, 4096
    raw, w = make(qtype, n=n, k=k, seed=11)
    packed = kg.pack_gguf(raw, qtype, k)
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 8, 64, 200):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(m, k, generator=g).to(DEV, dt)
            check(kg.gguf_matmul(x, packed, qtype, k, packed=True), x, w)


@cuda_only
@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q4_K], ids=lambda t: t.name)
def test_more_row_tiles_than_a_grid_axis_holds(qtype):
    """An output projection over a 128k vocabulary: more row tiles than a grid's y axis takes
    (65535), in every regime."""
    n, k = 70000, 256
    raw, w = make(qtype, n=n, k=k, seed=3)
    packed = kg.pack_gguf(raw, qtype, k)
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 3):
        x = torch.randn(m, k, generator=g).to(DEV)
        check(kg.gguf_matmul(x, packed, qtype, k, packed=True), x, w)


@cuda_only
def test_dequantize_at_load_is_dense_on_the_gpu():
    from pocketllm.quant.linear import GGUFLinear

    assert GGUFLinear.from_gguf(make(T.IQ2_XS)[0].cpu(), T.IQ2_XS, N, K, device="cuda").path == "triton"
    for qtype in (T.IQ2_XS, T.Q4_K):
        raw, w = make(qtype, seed=5)
        layer = GGUFLinear.from_gguf(raw.cpu(), qtype, N, K, device="cuda", dtype=torch.bfloat16,
                                     dequantize_at_load=True)
        assert layer.path == "dense" and layer._store.dtype == torch.bfloat16
        assert bool(((layer._store.float() - w).abs() <= 2.0 ** -8 * w.abs()).all())  # one bf16 rounding
        x = torch.randn(3, K, device="cuda", dtype=torch.bfloat16)
        check(layer(x), x, w)


def _q4_k_m_llama(root):
    """A 2-layer llama with rows of 256 (so the mix really is Q4_K / Q6_K), quantized to Q4_K_M."""
    from tiny_models import make_llama256

    from pocketllm.loaders.gguf_writer import write_gguf

    return write_gguf(make_llama256(root)[1], root / "llama256.Q4_K_M.gguf", "Q4_K_M").path


# A file of each type family. llama256 (K): Q4_K / Q6_K. qwen2 (legacy): rows of 96, so the
# Q4_K_M mix falls back to Q5_0 / Q8_0, and tied embeddings. The i-quant mixes, on random weights
# (dummy-gguf): IQ1_S; IQ1_M with IQ2_XXS and Q2_K; IQ2_M's IQ2_S with IQ3_S; IQ3_XXS with IQ2_S,
# IQ3_S and Q3_K; IQ4_XS with Q6_K.
GREEDY_FILES = ["llama256", "qwen2", "IQ1_S", "IQ1_M", "IQ2_M", "IQ3_XXS", "IQ4_XS"]
_SMALL_LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=384, max_position_embeddings=256,
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _greedy_file(kind, tiny_models, root):
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf
    from pocketllm.loaders.gguf_writer import write_gguf

    if kind == "llama256":
        return _q4_k_m_llama(root)
    if kind == "qwen2":
        return write_gguf(tiny_models["qwen2"][1], root / "qwen2.Q4_K_M.gguf", "Q4_K_M").path
    return write_dummy_gguf(root / f"llama.{kind}.gguf", _SMALL_LLAMA, kind, std=0.05).path


@cuda_only
@pytest.mark.parametrize("kind", GREEDY_FILES)
def test_gguf_greedy_tokens_on_cuda_equal_the_cpu(kind, tiny_models, tmp_path):
    """float32 on the GPU (Triton kernels, IEEE dots) against the CPU's exact path (each block
    dequantized exactly, float32 dots; ``exact_kernels``: not the 8-bit-activation kernels, which
    round the activations): the same greedy tokens."""
    from conftest import prompts_of

    from pocketllm import LLM, SamplingParams

    path = _greedy_file(kind, tiny_models, tmp_path)
    prompts = prompts_of([1, 7, 30, 65])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(path), device=device, dtype="float32", max_model_len=128, num_kv_blocks=64,
                  exact_kernels=True)
        if device == "cuda":
            paths = {m.path for m in llm.engine.runner.model.modules() if hasattr(m, "qtype")}
            assert paths == {"triton"}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens[device] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cuda"] == tokens["cpu"]


@cuda_only
@pytest.mark.parametrize("file_type", ["Q4_0", "Q4_K_M", "IQ2_XXS", "IQ3_XXS"])
def test_dummy_gguf_in_bf16_on_cuda_stays_close(file_type, tmp_path):
    """bf16 on the GPU (the 8-bit-activation GEMV where it covers the type) against float32 on the
    CPU's exact path: first-token logits within 5% of their range, for a file of each family."""
    from conftest import prompts_of
    from reference import captured_logits

    from pocketllm import LLM, SamplingParams
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf

    shape = dict(architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    path = write_dummy_gguf(tmp_path / "d.gguf", shape, file_type).path
    prompt = prompts_of([40], vocab=1000)[0]
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        llm = LLM(str(path), device=device, dtype=dtype, max_model_len=128, num_kv_blocks=32, exact_kernels=True)
        with captured_logits(llm) as captured:
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
        logits[device] = captured[0][0]
    ref = logits["cpu"]
    assert torch.isfinite(logits["cuda"]).all()
    assert float((logits["cuda"] - ref).abs().max()) < 0.05 * float(ref.abs().max())


@cuda_only
def test_norms_and_activations_writing_8_bit_forms_change_no_bit(tmp_path, monkeypatch):
    """bf16 decode of a Q4_K_M file: the GEMVs take the 8-bit forms that the norms, the gated
    activations and attention's split merge wrote, and the tokens and their logprobs are exactly
    those of quantizing in each GEMV."""
    from conftest import prompts_of

    from pocketllm import LLM, SamplingParams
    from pocketllm.kernels.triton import int8_act

    path = _q4_k_m_llama(tmp_path)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 33])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    given = []
    real = kg._gemv_q8  # every 8-bit GEMV launch, the CUDA C kernel's and Triton's

    def spy(kernel, x, packed, qtype, k, n, rows, split_k=None, x8=None, **kw):
        given.append(x8 is not None)
        return real(kernel, x, packed, qtype, k, n, rows, split_k, x8, **kw)

    monkeypatch.setattr(kg, "_gemv_q8", spy)
    runs, taken = [], []
    for written in (True, False):
        if not written:
            monkeypatch.setattr(int8_act, "wanted", lambda y, rows: False)
        given.clear()
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64,
                  enforce_eager=True)
        outs = llm.generate(prompts, params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        taken.append(list(given))
    assert runs[0] == runs[1]
    # Every decode GEMV took a written form; the one GEMV that quantized is the prefill step's output
    # layer, on the two rows it samples (indexed out of the step's hidden states).
    assert len(taken[0]) > 50 and taken[0].count(False) == 1
    assert len(taken[1]) == len(taken[0]) and not any(taken[1])


# ---- sm_90 resources: compiled here, without a GPU ----------------------------------------------

SM90_SHARED_LIMIT = 232448  # bytes of shared memory a block may use on H100 / H200 (227 KiB)


def sm90_resources(qtype, regime, dtype="bf16", block_m=16, cfg=None, k=4096):
    """(shared bytes, registers, spill bytes) of one kernel variant compiled for sm_90, with the
    specialisations a real launch gets (16-divisible pointers, row sizes, strides).  Needs a
    Triton that compiles (not the interpreter: see _sm90_table)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, _, targs = kg.type_args(qtype, k)
    c = dict(kg.kernel_config(regime, qtype), **(cfg or {}))
    if regime == "gemv":
        fn = kg._gemv_kernel
        extra = {"STAGES": c["num_stages"], "HAS_C": qtype in kg._OFFSET_TYPES, "GROUPED": False}
        opts = {"num_warps": c["num_warps"]}
    elif regime == "gemv_q8":
        fn, opts = kg._q8()._gemv_q8_kernel, {"num_warps": c["num_warps"]}
        targs = dict(QT=targs["QT"], BS=targs["S"] * targs["SPB"], BB=targs["BB"], HB=targs["HB"])
        extra = {"EMU": False, "GROUPED": False}
    elif regime == "mma":
        fn, opts = kg._mma().kernel, {"num_warps": c["num_warps"]}
        targs = dict(QT=targs["QT"], BPS=256 // kg.block_size(qtype))
        extra = {"WIDEN": False, "BLOCK_M": block_m, "BLOCK_K": c["BLOCK_K"], "STAGES": c["num_stages"],
                 "MOE": False, "DENSE": False}
    else:
        fn, extra, opts = kg._dequant_kernel, {"GATHER": False}, {"num_warps": c["num_warps"]}
    consts = dict(**targs, BLOCK_N=c["BLOCK_N"], **extra)
    if regime != "mma":
        consts["BPI"] = kg._blocks_per_step(qtype, c["BLOCK_K"])
    ptrs = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "lut_ptr": "*i32" if qtype in kg._LATTICE else "*fp32",
            "y_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "ids_ptr": "*i64", "pairs_ptr": "*i32", "experts_ptr": "*i32",
            "xq_ptr": "*i8", "xd_ptr": "*fp32",
            "xs_ptr": "*fp32"}
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    divisible = ["x_ptr", "w_ptr", "lut_ptr", "y_ptr", "out_ptr", "row_bytes", "hdr_start", "stride_xm",
                 "stride_ys", "stride_ym", "stride_on", "xq_ptr", "xd_ptr", "xs_ptr"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible if a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(re.search(r"LOCAL:(\d+)", res).group(1))
    return int(compiled.metadata.shared), regs, spill


def sm90_attention_resources(d: int, group: int, block_m: int, splits: int):
    """(shared bytes, registers, spill bytes) of the paged attention kernel compiled for sm_90 at head_dim `d`
    (bf16), `group` query heads a KV head in tiles of `block_m` rows, as `paged_attention` launches it."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pocketllm.kernels.triton import attention as ka

    fn, tiles, block_q = ka._paged_attention_kernel, ka.tile_config(d, 16, False, block_m), block_m // group
    consts = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), KV_BLOCK=16, TILE_N=tiles["TILE_N"],
                  BLOCK_Q=block_q, RUN=triton.next_power_of_2(block_q), BLOCK_M=block_m, USE_SOFTCAP=False,
                  USE_WINDOW=False, USE_SINKS=False, PRECISION="tf32", NUM_SPLITS=splits, CHAINS=False,
                  MERGE=splits > 1, QUANT_KV=False)
    bf16 = ("q_ptr", "k_cache", "v_cache", "k_scale", "v_scale", "out_ptr", "sinks")
    ptrs = {**{a: "*bf16" for a in bf16}, "part_acc": "*fp32", "part_ml": "*fp32", "scale": "fp32", "softcap": "fp32",
            **{a: "*i32" for a in ("tickets", "block_tables", "seq_lens", "query_start_loc", "chain_pos")}}
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    divisible = [a for a in fn.arg_names if a in ("q_ptr", "k_cache", "v_cache", "out_ptr") or a.startswith("stride_")]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(re.search(r"LOCAL:(\d+)", res).group(1))
    return int(compiled.metadata.shared), int(re.search(r"REG:(\d+)", res).group(1)), spill


# MLA's latent head (576 wide) under V2-Lite's 16 query heads and a tile of V3's 128: decode and prefill tiles,
# without key splits and with them
WIDE_ATTENTION = [(576, 16, 16, 1), (576, 16, 32, 1), (576, 32, 32, 1), (576, 16, 16, 4), (576, 32, 32, 4)]


def _sm90_variants():
    for d, group, block_m, splits in WIDE_ATTENTION:
        yield "attention", (d, group, splits), "bf16", block_m
    for qtype in COVERED:
        for dtype in ("bf16", "fp32"):
            yield qtype, "gemv", dtype, 1
            yield qtype, "dequant", dtype, 1
        if qtype in kg._q8().Q8_TYPES:
            yield qtype, "gemv_q8", "bf16", 1
        if qtype in kg._mma().MMA_TYPES:
            yield qtype, "mma", "bf16", 64


def _sm90_table():
    """Every variant's resources, compiled in a subprocess without TRITON_INTERPRET (under the
    interpreter, kernels cannot be compiled); None when this machine cannot compile for sm_90."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--sm90"], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(here))
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines or "error" in lines[0]:
        return None, (proc.stdout + proc.stderr)[-3000:]
    return lines, ""


def test_every_kernel_fits_sm90_shared_memory_and_registers():
    table, why = _sm90_table()
    if table is None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    assert len(table) == len(list(_sm90_variants()))
    for r in table:
        name = f"{r['type']} {r['regime']} {r['dtype']} BLOCK_M={r['block_m']}"
        assert r["shared"] <= SM90_SHARED_LIMIT, f"{name}: {r['shared']} bytes of shared memory"
        # (a wide head's split-key decode spills a little: its partial sums beside the tile; it runs at small batches)
        split_wide = r["type"] == "attention" and r["regime"][2] > 1
        assert r["spill"] == 0 or split_wide and r["spill"] <= 2048, f"{name}: spills {r['spill']} bytes"


if __name__ == "__main__" and sys.argv[1:] == ["--sm90"]:
    import json

    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"error": repr(e)}))
        raise SystemExit(0) from None
    def _one(v):
        qtype, regime, dtype, block_m = v
        if qtype == "attention":
            shared, regs, spill = sm90_attention_resources(regime[0], regime[1], block_m, regime[2])
            return dict(type=qtype, regime=regime, dtype=dtype, block_m=block_m, shared=shared, regs=regs, spill=spill)
        shared, regs, spill = sm90_resources(qtype, regime, dtype, block_m)
        return dict(type=qtype.name, regime=regime, dtype=dtype, block_m=block_m, shared=shared, regs=regs,
                    spill=spill)

    for v in _sm90_variants():
        print(json.dumps(_one(v)), flush=True)
