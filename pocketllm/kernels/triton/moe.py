"""Mixture-of-experts products on the GPU: every (token, expert) pair of a step multiplied in one
launch, with no host sync, so a decode step with experts is captured in a CUDA graph.

An expert projection is held as a stack: the E experts' matrices of N rows, one after the other
(GGUF: ``pack_gguf`` rows, multiplied by ``gguf.gguf_grouped_gemv``; dense: [E * N, K] in the
model's dtype, by ``_grouped_dense_kernel`` here).  Row p of a product is
``x[p // x_div] @ W[ids[p]].T``: the gate/up projection reads token p // top_k's activations
(x_div = top_k), the down projection its own row (x_div = 1).

Each pair reads its expert's weights: at a few tokens a step that is what a grouped GEMM reads
too; at many tokens the same expert is read once per token that chose it (from L2 where it fits),
which is why the layer keeps its sort-by-expert path for large steps (layers/moe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DENSE_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)


@triton.jit
def _grouped_dense_kernel(x_ptr, w_ptr, ids_ptr, y_ptr, N, K, x_div, stride_xm, stride_ym,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m // x_div, k] * W[ids[m] * N + n, k], float32 sums."""
    pid_n, m = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(ids_ptr + m).to(tl.int64) * N + n
    x_row = x_ptr + (m // x_div).to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + m * stride_ym + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def grouped_dense_gemv(x: torch.Tensor, stacked: torch.Tensor, n: int, ids: torch.Tensor,
                       x_div: int = 1) -> torch.Tensor:
    """[P, n] in x's dtype: row p = ``x[p // x_div] @ stacked[ids[p] * n : (ids[p] + 1) * n].T``
    for a dense stack [E * n, K]; ``ids`` (P of them) not checked."""
    k = stacked.shape[1]
    assert stacked.shape[0] % n == 0 and x.shape[1] == k and stacked.is_contiguous(), (stacked.shape, n, x.shape)
    ids = ids.reshape(-1).contiguous()
    x = x.contiguous()
    out = torch.empty((ids.numel(), n), dtype=x.dtype, device=x.device)
    if ids.numel():
        cfg = DENSE_CONFIG
        _grouped_dense_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), ids.numel())](
            x, stacked, ids, out, n, k, x_div, x.stride(0), out.stride(0), BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    return out
