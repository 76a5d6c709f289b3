"""LoRA adapter products over a step's rows grouped by adapter slot (Punica's SGMV scheme).

`y[r] += (x[r] @ A[s].T) @ B[s].T` for each row r of slot s, in place, reading only the slots the
step's rows use. The rows come as `perm` (row indices sorted by slot; rows without an adapter left
out) and `seg` (slot s owns perm[seg[s]:seg[s + 1]]), both on the device: a CUDA graph captured once
serves every mix of adapters, its grid sized for the most rows one slot can have.

Two launches a layer:
- shrink: program (slot, chunk of 16 rows, split of K) -> partial sums [splits, rows, width] (fp32):
  split K, so that one row reads its slot's A with many programs.
- expand: program (slot, chunk, block of N): sums the splits, multiplies by its block of B, adds to y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.kernels.platform import staged_for

BLOCK_M = 16  # rows a program takes (tl.dot's least)
BLOCK_K = 64
TILES_PER_SPLIT = 8  # K tiles a shrink program reads: a split is 512 values of K
BLOCK_N = 128


@triton.jit
def _shrink(x_ptr, a_ptr, perm_ptr, seg_ptr, part_ptr, M, K, stride_x, W, tiles,
            WP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(seg_ptr + s)
    end = tl.load(seg_ptr + s + 1)
    r0 = start + tl.program_id(1) * BM
    if r0 < end:
        offs_m = r0 + tl.arange(0, BM)
        m_ok = offs_m < end
        rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_w = tl.arange(0, WP)
        w_ok = offs_w < W
        a_rows = (s * W + offs_w).to(tl.int64)
        acc = tl.zeros((BM, WP), dtype=tl.float32)
        k0 = tl.program_id(2) * tiles * BK
        for t in range(tiles):
            offs_k = k0 + t * BK + tl.arange(0, BK)
            k_ok = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            at = tl.load(a_ptr + a_rows[:, None] * K + offs_k[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at), input_precision=PREC)
        tl.store(part_ptr + (tl.program_id(2) * M + rows[:, None]) * WP + offs_w[None, :], acc, mask=m_ok[:, None])


@triton.jit
def _expand(part_ptr, bt_ptr, perm_ptr, seg_ptr, y_ptr, M, N, stride_y, W, splits,
            WP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(seg_ptr + s)
    end = tl.load(seg_ptr + s + 1)
    r0 = start + tl.program_id(1) * BM
    if r0 < end:
        offs_m = r0 + tl.arange(0, BM)
        m_ok = offs_m < end
        rows = tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_w = tl.arange(0, WP)
        w_ok = offs_w < W
        xa = tl.zeros((BM, WP), dtype=tl.float32)
        for k in range(splits):
            xa += tl.load(part_ptr + (k * M + rows[:, None]) * WP + offs_w[None, :],
                          mask=m_ok[:, None] & w_ok[None, :], other=0.0)
        offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        b = tl.load(bt_ptr + (s * W + offs_w).to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=w_ok[:, None] & n_ok[None, :], other=0.0)
        out = tl.dot(xa.to(b.dtype), b, input_precision=PREC)
        yp = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        y_ok = m_ok[:, None] & n_ok[None, :]
        y = tl.load(yp, mask=y_ok, other=0.0)
        tl.store(yp, (y.to(tl.float32) + out).to(y.dtype), mask=y_ok)


def upload(values: list[int], *outs: torch.Tensor) -> None:
    """`values` into the int32 device buffers `outs`, one after the other, queued behind the device's work
    (from pinned memory on CUDA: the host does not wait for the steps in flight)."""
    host = staged_for(torch.tensor(values, dtype=torch.int32), outs[0].device)
    assert len(values) == sum(o.numel() for o in outs)
    i = 0
    for out in outs:
        out.copy_(host[i:i + out.numel()], non_blocking=True)
        i += out.numel()


def add_lora(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, y: torch.Tensor, perm: torch.Tensor,
             seg: torch.Tensor, chunks: int) -> None:
    """y [M, N] += each row's slot's product, in place. x [M, K]; a [slots * W, K]; bt [slots * W, N]
    (B transposed); perm, seg int32 as the module says; `chunks`: BLOCK_M-row chunks of the largest
    slot's rows (the grid's second axis)."""
    m, k = x.shape
    slots, n = seg.numel() - 1, y.shape[1]
    width = a.shape[0] // slots
    assert y.shape[0] == m and y.stride(1) == 1 and bt.shape == (a.shape[0], n) and a.shape[1] == k
    if x.dtype != a.dtype or x.stride(1) != 1:
        x = x.to(a.dtype).contiguous()
    wp = max(16, triton.next_power_of_2(width))
    splits = triton.cdiv(k, BLOCK_K * TILES_PER_SPLIT)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"  # (tf32 applies to float32 inputs only)
    part = torch.empty(splits, m, wp, dtype=torch.float32, device=x.device)
    _shrink[(slots, chunks, splits)](x, a, perm, seg, part, m, k, x.stride(0), width, TILES_PER_SPLIT,
                                     WP=wp, BM=BLOCK_M, BK=BLOCK_K, PREC=prec)
    _expand[(slots, chunks, triton.cdiv(n, BLOCK_N))](part, bt, perm, seg, y, m, n, y.stride(0), width, splits,
                                                       WP=wp, BM=BLOCK_M, BN=BLOCK_N, PREC=prec)
