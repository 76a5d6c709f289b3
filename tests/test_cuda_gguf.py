"""The CUDA C GGUF GEMV (pocketllm/kernels/cuda/gguf_gemv.cu) against gguf's dequantization.

Without a GPU the decoders run on the CPU: the same source, compiled as C++ by the system
compiler, computes each row's dot product piece by piece as the kernel's threads do, and must
equal the product of the dequantized weights with the 8-bit activations (integer sums, float32
scaling).  With a GPU the kernel itself runs, for every output dtype, two activation rows, row counts
that are no multiple of its rows a block, and the mixture-of-experts stacks.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch
from test_quant_linear import realistic_blocks

from pocketllm.kernels import dispatch
from pocketllm.kernels.cuda import gguf_gemv as cg
from pocketllm.kernels.cuda import gguf_mmq
from pocketllm.kernels.triton import gguf as kg
from pocketllm.kernels.triton.int8_act import quantize_activations
from pocketllm.quant.dequant import dequantize

T = gguf.GGMLQuantizationType
TYPES = sorted(cg.CUDA_GEMV_TYPES, key=lambda t: t.value)

_HARNESS = """
#include "{src}"
#define ROW_DOT(name, ACT, RAW, BODY, HDR, PIECES) \\
extern "C" float host_##name(const u8* row, int hdr_start, int n_blocks, const i8* xq, const float* xd, \\
                             const float* xs, const u32* tab) {{ \\
    float acc = 0.0f; \\
    for (int pc = 0; pc < n_blocks * PIECES; pc++) {{ \\
        int blk = pc / PIECES, sub = pc % PIECES; \\
        RAW w; name##_load(w, row + BODY * blk, row + hdr_start + HDR * blk, sub); \\
        ACT a; name##_act(a, xq, xd, xs, blk, sub); \\
        acc += name##_dot(w, a, sub, tab); \\
    }} \\
    return acc; \\
}}
{instances}
"""


def _host_library(tmp_path_factory, name: str, text: str) -> ctypes.CDLL:
    """The C++ program ``text`` (the CUDA sources' host-compilable parts) built as a shared library."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp(name)
    (d / "h.cpp").write_text(text)
    done = subprocess.run([cxx, "-O1", "-shared", "-fPIC", str(d / "h.cpp"), "-o", str(d / "h.so")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(d / "h.so"))


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    inst = "\n".join(f"ROW_DOT({n}, Act{n.upper()}, Raw{n.upper()}, {n.upper()}_BODY, {n.upper()}_HDR, "
                     f"{n.upper()}_PIECES)" for n in cg.DECODERS.values())
    return _host_library(tmp_path_factory, "cuda_host", _HARNESS.format(src=cg.SOURCE, instances=inst))


def test_geometry_is_the_packed_layout():
    for qtype in TYPES:
        g = cg.geometry(qtype)
        _, _, body = kg._LAYOUT[qtype]
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        assert (g["BLOCK"], g["BODY"], g["HDR"]) == (bs, body, ts - body)
        if g["LUT"]:  # the grid's words in value_table (after 128 sign words)
            assert g["LUT"] == kg.value_table(torch.device("cpu"), qtype).numel() - 128


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoders_equal_the_dequantized_product(qtype, host_decoders):
    n, k = 6, 1024
    rng = np.random.default_rng(qtype.value)
    raw = torch.from_numpy(realistic_blocks(rng, qtype, n, k))
    w = dequantize(raw, qtype, (n, k)).double().numpy()
    packed = np.ascontiguousarray(kg.pack_gguf(raw, qtype, k).numpy())
    _, hdr_start, _ = kg.type_args(qtype, k)
    x = torch.from_numpy(rng.standard_normal((1, k), np.float32))  # quantized by the Triton kernel (interpreted on a CPU)
    xq, xd, xs = (t.cpu().numpy() for t in quantize_activations(x.cuda() if torch.cuda.is_available() else x))
    xdeq = (xq.astype(np.float64).reshape(-1, 32) * xd.astype(np.float64).reshape(-1, 1)).reshape(k)
    tab = np.ascontiguousarray(kg.value_table(torch.device("cpu"), qtype).numpy()[128:].view(np.uint32))
    fn = getattr(host_decoders, f"host_{cg.DECODERS[qtype]}")
    fn.restype = ctypes.c_float
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for r in range(n):
        got = fn(p(packed[r]), hdr_start, k // cg.geometry(qtype)["BLOCK"], p(xq), p(xd), p(xs), p(tab))
        ref, mag = float(w[r] @ xdeq), float(np.abs(w[r]) @ np.abs(xdeq))
        assert abs(got - ref) <= 1e-5 * mag, (r, got, ref)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_the_dequantized_product(qtype):
    assert cg.usable(qtype, torch.device("cuda"))
    n, k = 1000, 2048  # n: no multiple of any R
    rng = np.random.default_rng(qtype.value)
    raw = torch.from_numpy(realistic_blocks(rng, qtype, n, k))
    w = dequantize(raw, qtype, (n, k)).double().cuda()
    packed = kg.pack_gguf(raw.cuda(), qtype, k)
    x = torch.randn(2, k, device="cuda")
    xq, xd, xs = quantize_activations(x)
    xdeq = (xq.double().view(2, -1, 32) * xd.double()[..., None]).view(2, k)
    ref, mag = xdeq @ w.T, xdeq.abs() @ w.abs().T
    # (R, NT, W): W = 1 strides tiles over one block an SM (a few tiles each), 0 a block a tile
    tiles = {torch.float32: [(2, 64, 0)], torch.float16: [(2, 64, 1)],
             torch.bfloat16: [(1, 64, 0), (2, 64, 0), (4, 128, 0), (8, 256, 0), (4, 128, 1)]}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -10)):
        for r, nt, w in tiles[dtype]:
            y = cg.gemv(xq, xd, xs, packed, qtype, k, n, 2, dtype, r=r, nt=nt, w=w)
            assert y.dtype == dtype and y.shape == (2, n)
            err = (y.double() - ref).abs()
            assert bool((err <= tol * mag + 1e-30).all()), (dtype, r, nt, w, float((err / mag).max()))
    # the weight as a stack of 5 matrices of 200 rows (experts): pairs (x row p // 2, matrix ids[p])
    e_rows = 200
    ids = torch.tensor([4, 0, 2, 4], device="cuda")
    y = cg.gemv(xq, xd, xs, packed, qtype, k, e_rows, 4, torch.float32, ids=ids, x_div=2)
    for p, e in enumerate(ids.tolist()):
        want = ref[p // 2, e * e_rows:(e + 1) * e_rows]
        assert bool(((y[p].double() - want).abs() <= 1e-5 * mag[p // 2, e * e_rows:(e + 1) * e_rows]).all())


@cuda_only
def test_gemv_q8_takes_the_cuda_kernel_for_its_types(monkeypatch):
    """gguf_matmul's 8-bit regime runs the CUDA C kernel for CUDA_GEMV_TYPES (and the Triton one when
    POCKETLLM_DISABLE_CUDA_C=1): the two agree to the bf16 output's rounding."""
    n, k = 512, 4096
    for qtype in TYPES:
        raw = torch.from_numpy(realistic_blocks(np.random.default_rng(1), qtype, n, k)).cuda()
        packed = kg.pack_gguf(raw, qtype, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        calls = []
        real = cg.gemv
        monkeypatch.setattr(cg, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        y = kg.gguf_matmul(x, packed, qtype, k, packed=True)
        assert calls, qtype
        monkeypatch.setenv("POCKETLLM_DISABLE_CUDA_C", "1")
        y_triton = kg.gguf_matmul(x, packed, qtype, k, packed=True)
        monkeypatch.undo()
        assert torch.allclose(y.float(), y_triton.float(), rtol=2 ** -7, atol=1e-3 * float(y_triton.abs().max()))


_TILE_HARNESS = """
#include "{gemv}"
#include "{mmq}"
#define TILE_CODES(name, UNITS) \\
extern "C" void host_codes_##name(const u8* row, int hdr_start, int n_steps, const u32* lut, i8* out) {{ \\
    MmqTile* t = new MmqTile; \\
    for (int step = 0; step < n_steps; step++) {{ \\
        for (int u = 0; u < UNITS; u++) name##_tile(*t, 0, row, hdr_start, step, u, lut); \\
        for (int i = 0; i < KB; i++) out[KB * step + i] = t->w[0][i]; \\
    }} \\
    delete t; \\
}}
#define TILE_ROW(name, UNITS, G, MIN) \\
extern "C" void host_tile_##name(const u8* row, int hdr_start, int n_steps, const u32* lut, float* out) {{ \\
    MmqTile* t = new MmqTile; \\
    for (int step = 0; step < n_steps; step++) {{ \\
        for (int u = 0; u < UNITS; u++) name##_tile(*t, 0, row, hdr_start, step, u, lut); \\
        for (int i = 0; i < KB; i++) \\
            out[KB * step + i] = t->ws[0][i / G] * (float)t->w[0][i] - (MIN ? t->wm[0][i / G] : 0.0f); \\
    }} \\
    delete t; \\
}}
{instances}
"""


@pytest.fixture(scope="module")
def host_tiles(tmp_path_factory):
    names = [cg.DECODERS[t] for t in gguf_mmq.MMQ_TYPES]
    inst = "\n".join(f"TILE_ROW({n}, {n.upper()}_UNITS, {n.upper()}_G, {n.upper()}_MIN)\n"
                     f"TILE_CODES({n}, {n.upper()}_UNITS)" for n in names)
    return _host_library(tmp_path_factory, "cuda_tiles",
                         _TILE_HARNESS.format(gemv=cg.SOURCE, mmq=gguf_mmq.SOURCE, instances=inst))


@pytest.mark.parametrize("qtype", sorted(gguf_mmq.MMQ_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_mmq_tiles_are_the_dequantized_weights(qtype, host_tiles):
    """The integer tensor-core kernel's tile decoders (gguf_mmq.cu, compiled as host C++): a row's int8 codes
    times their group's scale, minus its minimum, are gguf's dequantized weights."""
    n, k = 4, 1024
    raw = torch.from_numpy(realistic_blocks(np.random.default_rng(qtype.value), qtype, n, k))
    w = dequantize(raw, qtype, (n, k)).numpy()
    packed = np.ascontiguousarray(kg.pack_gguf(raw, qtype, k).numpy())
    lut = np.ascontiguousarray(kg.value_table(torch.device("cpu"), qtype).numpy().view(np.uint32))
    fn = getattr(host_tiles, f"host_tile_{cg.DECODERS[qtype]}")
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for r in range(n):
        out = np.empty(k, np.float32)
        fn(p(packed[r]), kg.type_args(qtype, k)[1], k // 256, p(lut), p(out))
        np.testing.assert_allclose(out, w[r], rtol=0, atol=1e-6 * float(np.abs(w[r]).max()))


@cuda_only
@pytest.mark.parametrize("qtype", sorted(gguf_mmq.MMQ_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_mmq_equals_the_dequantized_product(qtype):
    """The integer tensor-core product of several activation rows: every row and weight row (none a multiple
    of the 64 x 64 tile), K split or not, equal to the dequantized weights times the 8-bit activations; for
    the 32-weight types a K that ends a block into a step too."""
    n, ks = 1000, (2048, 2080) if qtype in gguf_mmq._K32 else (2048,)
    for k in ks:
        _mmq_product_case(qtype, n, k)


def _mmq_product_case(qtype, n, k):
    rng = np.random.default_rng(qtype.value)
    raw = torch.from_numpy(realistic_blocks(rng, qtype, n, k))
    w = dequantize(raw, qtype, (n, k)).double().cuda()
    packed = kg.pack_gguf(raw.cuda(), qtype, k)
    for m, splits in ((3, 1), (17, 3), (64, None), (130, 2)):
        xq, xd, xs = quantize_activations(torch.randn(m, k, device="cuda"))
        xdeq = (xq.double().view(m, -1, 32) * xd.double()[..., None]).view(m, k)
        ref, mag = xdeq @ w.T, xdeq.abs() @ w.abs().T
        y = gguf_mmq.mmq(xq, xd, xs, packed, qtype, k, n, m, torch.float32, splits=splits)
        assert y.shape == (m, n)
        err = (y.double() - ref).abs()
        assert bool((err <= 1e-5 * mag + 1e-30).all()), (m, splits, float((err / mag).max()))


_X16_TYPES = sorted((t for t in gguf_mmq.MMQ_TYPES if gguf_mmq.x16_ok(t)), key=lambda t: t.value)


@pytest.mark.parametrize("qtype", _X16_TYPES, ids=lambda t: t.name)
def test_mmq_x16_types_have_7_bit_codes(qtype, host_tiles):
    """The bf16 variant turns a tile's int8 codes into bf16 through code + <TYPE>_BIAS as a 7-bit byte: every
    code its decoder writes (gguf_mmq.cu as host C++, realistic blocks) lies in that window."""
    n, k = 8, 1024
    raw = torch.from_numpy(realistic_blocks(np.random.default_rng(qtype.value + 1), qtype, n, k))
    packed = np.ascontiguousarray(kg.pack_gguf(raw, qtype, k).numpy())
    lut = np.ascontiguousarray(kg.value_table(torch.device("cpu"), qtype).numpy().view(np.uint32))
    name = cg.DECODERS[qtype]
    bias = gguf_mmq.define(qtype, "BIAS")
    fn = getattr(host_tiles, f"host_codes_{name}")
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lo, hi = 127, -128
    for r in range(n):
        codes = np.empty(k, np.int8)
        fn(p(packed[r]), kg.type_args(qtype, k)[1], k // 256, p(lut), p(codes))
        lo, hi = min(lo, int(codes.min())), max(hi, int(codes.max()))
    assert 0 <= lo + bias and hi + bias <= 127, (lo, hi, bias)


@cuda_only
@pytest.mark.parametrize("qtype", _X16_TYPES, ids=lambda t: t.name)
def test_mmq_x16_equals_the_dequantized_product(qtype):
    """The bf16 variant: every row and weight row (none a multiple of the tile), K split or not (a K that
    ends a block into a step for the 32-weight types), against the dequantized weights times the bf16
    activations, to the rounding of the weights to bf16 (their scale and minimum rounded too)."""
    n = 1000
    for k in (2048, 2080) if qtype in gguf_mmq._K32 else (2048,):
        rng = np.random.default_rng(qtype.value)
        raw = torch.from_numpy(realistic_blocks(rng, qtype, n, k))
        w = dequantize(raw, qtype, (n, k)).double().cuda()
        packed = kg.pack_gguf(raw.cuda(), qtype, k)
        for m, splits, bm in ((3, 1, None), (17, 3, None), (40, None, 16), (64, None, None), (130, 2, 64)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref, mag = x.double() @ w.T, x.double().abs() @ w.abs().T
            y = gguf_mmq.mmq_x16(x, packed, qtype, k, n, splits=splits, bm=bm)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            err = (y.double() - ref).abs()
            assert bool((err <= 2 ** -5 * mag + 1e-30).all()), (k, m, splits, float((err / mag).max()))
            assert float(err.norm() / ref.norm()) < 2 ** -7, (k, m, float(err.norm() / ref.norm()))


@cuda_only
@pytest.mark.parametrize("qtype", sorted(gguf_mmq.MMQ_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_auto_takes_mmq_for_its_rows(qtype, monkeypatch):
    """gguf_matmul's auto regime: the integer tensor-core kernel from GEMV_MAX_M + 1 rows to MMQ_MAX_M (to
    MMA_MAX_M for MMQ_WIDE_TYPES), 16-bit activations only; its bf16 variant, where it takes the type, from
    MMQ_X16_MIN_M to MMQ_X16_MAX_M rows of bf16 activations; their outputs that of dequantize + cuBLAS to the
    8-bit activations' or bf16 weights' rounding."""
    n, k = 300, 1024
    raw = torch.from_numpy(realistic_blocks(np.random.default_rng(5), qtype, n, k)).cuda()
    packed = kg.pack_gguf(raw, qtype, k)
    seen, seen16 = [], []
    real, real16 = gguf_mmq.mmq, gguf_mmq.mmq_x16
    monkeypatch.setattr(gguf_mmq, "mmq", lambda *a, **kw: seen.append(a[7]) or real(*a, **kw))
    monkeypatch.setattr(gguf_mmq, "mmq_x16", lambda *a, **kw: seen16.append(a[0].shape[0]) or real16(*a, **kw))
    x16 = gguf_mmq.x16_ok(qtype)
    d = dispatch
    top = d.MMQ_X16_MIN_M - 1 if x16 else d.MMA_MAX_M if qtype in d.MMQ_WIDE_TYPES else d.MMQ_MAX_M
    rows = (d.GEMV_MAX_M, d.GEMV_MAX_M + 1, d.MMQ_X16_MIN_M - 1, d.MMQ_X16_MIN_M, d.MMQ_MAX_M,
            d.MMQ_MAX_M + 1, d.MMA_MAX_M, d.MMA_MAX_M + 1, d.MMQ_X16_MAX_M, d.MMQ_X16_MAX_M + 1)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = kg.gguf_matmul(x, packed, qtype, k, packed=True)
        ref = kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="dequant").float()
        assert float((y.float() - ref).abs().max()) <= 0.03 * float(ref.abs().max()), m
    kg.gguf_matmul(torch.randn(8, k, device="cuda"), packed, qtype, k, packed=True)  # float32: exact paths
    kg.gguf_matmul(torch.randn(48, k, device="cuda", dtype=torch.float16), packed, qtype, k, packed=True)
    assert seen == [m for m in rows if dispatch.GEMV_MAX_M < m <= top] + [48] * (qtype in dispatch.MMQ_WIDE_TYPES)
    assert seen16 == [m for m in rows if x16 and dispatch.MMQ_X16_MIN_M <= m <= dispatch.MMQ_X16_MAX_M]
    if x16:  # asked for, the bf16 variant rounds other activations to bf16 and answers in their dtype
        x = torch.randn(20, k, device="cuda")
        y = kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="mmq_x16")
        ref = kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="dequant")
        assert y.dtype == torch.float32 and float((y - ref).abs().max()) <= 0.03 * float(ref.abs().max())


@cuda_only
@pytest.mark.parametrize("qtype", sorted(gguf_mmq.MMQ_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_mmq_moe_multiplies_each_pair_by_its_expert(qtype, monkeypatch):
    """The integer tensor-core kernel over a mixture-of-experts layer's pairs sorted by expert (experts chosen
    by several tokens, by one, by none, more pairs than a row block; blocks of 16 and 32): row p is
    x[p // x_div] . W[ids[p]]^T for the 8-bit activations; fused_moe takes it for 16-bit activations."""
    from pocketllm.kernels.triton import moe

    n, k, experts = 200, 544 if qtype in gguf_mmq._K32 else 512, 5  # (544: a step of one block)
    raw = torch.from_numpy(realistic_blocks(np.random.default_rng(9), qtype, experts * n, k))
    w = dequantize(raw, qtype, (experts * n, k)).double().cuda()
    stacked = kg.pack_gguf(raw.cuda(), qtype, k)
    ids = torch.tensor([[4, 1]] * 37 + [[2, 0]], device="cuda")  # 4 and 1: 37 pairs each, 3: none
    for block_m in (16, 32):
        routing = moe.align(ids, experts, block_m=block_m)
        for x_div, rows in ((2, 38), (1, 76)):
            xq, xd, xs = quantize_activations(torch.randn(rows, k, device="cuda"))
            xdeq = (xq.double().view(rows, -1, 32) * xd.double()[..., None]).view(rows, k)
            y = gguf_mmq.moe(xq, xd, xs, stacked, qtype, k, n, routing, x_div, torch.float32)
            assert y.shape == (76, n)
            for p, e in enumerate(ids.flatten().tolist()):
                we = w[e * n:(e + 1) * n]
                ref, mag = xdeq[p // x_div] @ we.T, xdeq[p // x_div].abs() @ we.abs().T
                assert bool(((y[p].double() - ref).abs() <= 1e-5 * mag + 1e-30).all()), (block_m, x_div, p)
    seen = []
    real = gguf_mmq.moe
    monkeypatch.setattr(gguf_mmq, "moe", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    x = torch.randn(38, k, device="cuda", dtype=torch.bfloat16)
    moe.fused_moe(x, stacked, qtype, k, n, moe.align(ids, experts, block_m=16), 2)
    if qtype in kg._mma().MMA_TYPES:  # float32: the Triton tile kernel's (IQ2_XXS has none)
        moe.fused_moe(x.float(), stacked, qtype, k, n, moe.align(ids, experts, block_m=16), 2)
    assert seen == [1]
