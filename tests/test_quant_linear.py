"""GGUFLinear and gguf_embedding_lookup against gguf's dequantized weights.

Tolerances (u = 2**-24, float32 unit roundoff):

* dense / planes / scratch rebuild the weights bit-exactly, so outputs differ
  from ``x @ W.T`` only in summation order: |dy| <= 2*K*u * (|x| @ |W|.T), the
  worst-case bound for two differently ordered float32 dot products of length K.
"""

import gguf
import numpy as np
import pytest
import torch
from test_quant_dequant import F16_FIELDS, random_blocks

from pocketllm.core.gguf_types import SUPPORTED_TYPES
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.quant import linear as qlinear
from pocketllm.quant.dequant import AFFINE_TYPES, dequantize
from pocketllm.quant.linear import GGUFLinear, gguf_embedding_lookup

T = gguf.GGMLQuantizationType
ALL = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
U = 2.0 ** -24
N, K = 80, 512  # 5 row tiles of 16, 2 super-blocks / 16 blocks per row


def realistic_blocks(rng, qtype, rows, cols):
    """Random codes with finite, model-like scales, so matmuls stay finite."""
    if qtype in (T.F32, T.F16, T.BF16):
        dt = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        w = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32)).to(dt)
        return w.view(torch.uint8).numpy().reshape(rows, -1)
    raw = random_blocks(rng, qtype, rows, cols)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blk = raw.reshape(-1, ts)
    for off in F16_FIELDS.get(qtype, []):
        scale = rng.uniform(1e-3, 2e-2, blk.shape[0]) * rng.choice([-1, 1], blk.shape[0])
        blk[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:
        blk[:, 0] = rng.integers(115, 128, blk.shape[0])  # e8m0 exponent near 2**-5
    if qtype == T.IQ1_M:
        sc = blk[:, 48:56].copy().view(np.uint16)
        v = np.full(blk.shape[0], 0x2000, np.uint16)  # d = 2**-7
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((v >> (4 * i)) & 0xF) << 12)
        blk[:, 48:56] = sc.view(np.uint8)
    return raw


def make(qtype, seed=0, n=N, k=K):
    raw = realistic_blocks(np.random.default_rng(seed), qtype, n, k)
    w = dequantize(torch.from_numpy(raw), qtype, (n, k))
    assert torch.isfinite(w).all()
    return torch.from_numpy(raw), w


def paths_of(qtype):
    """Every path a type can take: the C kernel, the torch paths."""
    quantized = qtype not in (T.F32, T.F16, T.BF16)
    return (["auto"] + (["scratch"] if quantized else []) + (["c"] if gguf_ops.supports(qtype) else [])
            + (["planes"] if qtype in AFFINE_TYPES else []))


def check_close(y, x, w, slack=None):
    ref = x @ w.T
    tol = 2 * K * U * (x.abs() @ w.abs().T) + 1e-30
    if slack is not None:
        tol = tol + slack
    err = (y - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max():.3g}, err/tol {(err / tol).max():.3g}"


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_forward_matches_dequantized_matmul(qtype):
    raw, w = make(qtype, seed=qtype.value)
    layers = {p: GGUFLinear.from_gguf(raw, qtype, N, K, path=p) for p in paths_of(qtype)}
    g = torch.Generator().manual_seed(qtype.value)
    for batch in (1, 3, 17):
        x = torch.randn(batch, K, generator=g)
        for path, layer in layers.items():
            y = layer(x)
            assert y.shape == (batch, N) and y.dtype == torch.float32
            check_close(y, x, w)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_rebuilt_weights_are_exact(qtype):
    # x = I turns the layer's output into its (transposed) effective weights
    raw, w = make(qtype, seed=100 + qtype.value)
    layer = GGUFLinear.from_gguf(raw, qtype, N, K)
    assert layer.path == ("dense" if qtype in (T.F32, T.F16, T.BF16) else
                          "c" if gguf_ops.supports(qtype) else
                          "scratch" if qtype.name.startswith(("IQ", "MX")) else "planes")
    for path in paths_of(qtype):
        assert torch.equal(GGUFLinear.from_gguf(raw, qtype, N, K, path=path)(torch.eye(K)).T, w), path


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K, T.IQ4_XS, T.F16], ids=lambda t: t.name)
def test_chunked_forward_bias_and_leading_dims(qtype, monkeypatch):
    monkeypatch.setattr(qlinear, "SCRATCH_BYTES", 4 * K * 7)  # 7 rows per chunk, ragged tail
    raw, w = make(qtype, seed=300)
    bias = torch.randn(N)
    layer = GGUFLinear.from_gguf(raw, qtype, N, K, bias=bias)
    x = torch.randn(2, 5, K)
    y = layer(x)
    assert y.shape == (2, 5, N)
    check_close(y.reshape(10, N) - bias, x.reshape(10, K), w, slack=1e-6)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_memory_stays_quantized(qtype):
    raw, w = make(qtype, seed=1)
    layer = GGUFLinear.from_gguf(raw, qtype, N, K)
    if layer.path == "dense":
        assert layer.nbytes() == 4 * N * K  # float types are widened to float32
    elif layer.path == "scratch":
        assert layer.nbytes() == raw.numel()
        assert layer._store.data_ptr() == raw.data_ptr()  # not even copied
    else:  # planes: same bits; k-quant 6-bit sub-scales take a byte each
        assert raw.numel() <= layer.nbytes() <= 1.2 * raw.numel()
    dense = GGUFLinear.from_gguf(raw, qtype, N, K, dequantize_at_load=True)
    assert dense.path == "dense" and dense.nbytes() == 4 * N * K
    assert torch.equal(dense(torch.eye(K)).T, w)
    assert (layer.qtype, layer.out_features, layer.in_features) == (qtype, N, K)


def test_bad_arguments():
    raw, _ = make(T.Q8_0)
    with pytest.raises(ValueError, match="path must be one of"):
        GGUFLinear.from_gguf(raw, T.Q8_0, N, K, path="int4")
    with pytest.raises(ValueError, match="needs"):
        GGUFLinear.from_gguf(raw, T.Q8_0, N + 1, K)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_embedding_lookup_is_exact(qtype):
    rng = np.random.default_rng(qtype.value)
    raw = torch.from_numpy(random_blocks(rng, qtype, 50, 256))
    table = dequantize(raw, qtype, (50, 256))
    ids = torch.tensor([[3, 0, 49], [3, 17, 17]])
    out = gguf_embedding_lookup(raw, qtype, 50, 256, ids)
    assert out.shape == (2, 3, 256)
    assert torch.equal(out.view(torch.int32), table[ids].view(torch.int32))
    flat = gguf_embedding_lookup(raw.reshape(-1), qtype, 50, 256, torch.tensor([7]))
    assert torch.equal(flat.view(torch.int32), table[7:8].view(torch.int32))
    with pytest.raises(IndexError):
        gguf_embedding_lookup(raw, qtype, 50, 256, torch.tensor([50]))
