"""A bf16 / fp16 GEMM whose every output row is the same bits whatever the number of rows.

cuBLAS picks its kernel (tile, K split) by shape: on the H200 it gives a row the same bits at 1 to 48 rows
for every projection of the 8B shape, but ``o`` and ``down`` change class at 64 rows and beyond
(results/h200-cublas-row-invariance.json), so a speculative step of 64 sequences and their drafts (80-320
rows) computes other bits than a step of 64 (docs/performance/speculative-decoding.md, "Key splits, not
GEMMs").  Here the tile, the K split
and the order the splits are added in depend on N and K alone: row m's output is sum over the splits s
(in order) of its tile's tl.dot over split s's K range (in BLOCK_K steps), the same at any M.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .split_sum import sum_splits

# cuBLAS's classes agree to 48 rows (results/h200-cublas-row-invariance.json): from 49 the layers that
# take this GEMM (the row-parallel ones, o and down, under speculative decoding) leave cuBLAS
FROM_ROWS = 49
CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
SPLIT_K = 2048  # weights of K a split: ceil(K / SPLIT_K) splits, from K alone
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # its tl.dot reads bf16 as integers


@triton.jit(do_not_specialize=["M"])
def _kernel(x_ptr, w_ptr, part_ptr, M, N, K, stride_x, stride_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """part[z, m, n] = x[m, zC:(z+1)C] . w[n, zC:(z+1)C] (C = CHUNK, float32)."""
    pn, pm, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(z * CHUNK, tl.minimum(K, (z + 1) * CHUNK), BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if WIDEN:  # (the interpreter: the same values in float32)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    out = part_ptr + (z.to(tl.int64) * M + rm[:, None]) * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] . w [N, K]^T (+ bias) in x's dtype, row m the same bits at any M (see the module docs)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype
    if m == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    splits = triton.cdiv(k, SPLIT_K)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    cfg = CONFIG
    _kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), splits)](
        x, w, part, m, n, k, x.stride(0), w.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], CHUNK=SPLIT_K, WIDEN=INTERPRET,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return sum_splits(part, x.dtype, bias)
