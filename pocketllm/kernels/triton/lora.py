"""LoRA adapter products over a step's rows grouped by adapter slot (Punica's SGMV scheme).

`y[r] += (x[r] @ A[s].T) @ B[s].T` for each row r of slot s, reading only the slots the step's rows
use. The rows come as `perm` (row indices sorted by slot; rows without an adapter left out) and
`chunks`, one (slot, first, end) triple of positions in perm per BLOCK_M rows of a slot, (0, 0, 0) past
the step's: both on the device and of fixed size, so a CUDA graph captured once (its grid as many
chunks as its rows can make) serves every mix of adapters.

Two launches a layer:
- shrink: program (chunk, split of K) -> partial sums [splits, rows, width] (fp32): K split, so that
  one row reads its slot's A with many programs. It runs on a second stream, beside the layer's own
  product (both read only x), so that one launch, not two, follows the product.
- expand: program (chunk, block of N): sums the splits, multiplies by its block of B, adds to y.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pocketllm.kernels.platform import staged_for

BLOCK_M = 16  # rows a program takes (tl.dot's least)
BLOCK_K = 64
TILES_PER_SPLIT = 8  # K tiles a shrink program reads: a split is 512 values of K
BLOCK_N = 256


def max_chunks(rows: int, slots: int) -> int:
    """The most chunks `rows` rows over `slots` slots make."""
    return triton.cdiv(rows, BLOCK_M) + min(rows, slots)


@triton.jit
def _chunk(chunk_ptr, perm_ptr, BM: tl.constexpr):
    """This program's chunk: its slot, whether it has rows, and those rows (BM, masked)."""
    s = tl.load(chunk_ptr + tl.program_id(0) * 3)
    r0 = tl.load(chunk_ptr + tl.program_id(0) * 3 + 1)
    end = tl.load(chunk_ptr + tl.program_id(0) * 3 + 2)
    offs_m = r0 + tl.arange(0, BM)
    m_ok = offs_m < end
    return s, r0 < end, tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64), m_ok


@triton.jit
def _shrink(x_ptr, a_ptr, perm_ptr, chunk_ptr, part_ptr, M, K, stride_x, W, tiles,
            WP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    s, live, rows, m_ok = _chunk(chunk_ptr, perm_ptr, BM)
    if live:
        offs_w = tl.arange(0, WP)
        w_ok = offs_w < W
        a_rows = (s * W + offs_w).to(tl.int64)
        acc = tl.zeros((BM, WP), dtype=tl.float32)
        k0 = tl.program_id(1) * tiles * BK
        for t in range(tiles):
            offs_k = k0 + t * BK + tl.arange(0, BK)
            k_ok = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            at = tl.load(a_ptr + a_rows[:, None] * K + offs_k[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at), input_precision=PREC)
        tl.store(part_ptr + (tl.program_id(1) * M + rows[:, None]) * WP + offs_w[None, :], acc, mask=m_ok[:, None])


@triton.jit
def _expand(part_ptr, bt_ptr, perm_ptr, chunk_ptr, y_ptr, M, N, stride_y, W, splits,
            WP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    s, live, rows, m_ok = _chunk(chunk_ptr, perm_ptr, BM)
    if live:
        offs_w = tl.arange(0, WP)
        w_ok = offs_w < W
        xa = tl.zeros((BM, WP), dtype=tl.float32)
        for k in range(splits):
            xa += tl.load(part_ptr + (k * M + rows[:, None]) * WP + offs_w[None, :],
                          mask=m_ok[:, None] & w_ok[None, :], other=0.0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
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
        out.view(-1).copy_(host[i:i + out.numel()], non_blocking=True)
        i += out.numel()


def chunks_of(counts: list[int]) -> list[tuple[int, int, int]]:
    """(slot, first, end) per BLOCK_M rows of each slot, for rows sorted by slot with `counts` a slot."""
    out, start = [], 0
    for slot, n in enumerate(counts):
        out += [(slot, r, min(r + BLOCK_M, start + n)) for r in range(start, start + n, BLOCK_M)]
        start += n
    return out


_streams: dict[torch.device, torch.cuda.Stream] = {}


class Shrunk:
    """A shrink in flight: its partial sums, and the stream it runs on (None: the current one)."""

    def __init__(self, part: torch.Tensor, splits: int, stream):
        self.part, self.splits, self.stream = part, splits, stream


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (tf32 applies to float32 inputs only)


def shrink(x: torch.Tensor, a: torch.Tensor, perm: torch.Tensor, chunks: torch.Tensor, grid: int,
           width: int) -> Shrunk:
    """Starts x [M, K] times each row's slot's A (a [slots * width, K]); on CUDA on a second stream that
    waits for the current one, so that the layer's own product runs beside it. `grid`: chunks to cover."""
    m, k = x.shape
    if x.dtype != a.dtype or x.stride(1) != 1:
        x = x.to(a.dtype).contiguous()
    wp = max(16, triton.next_power_of_2(width))
    splits = triton.cdiv(k, BLOCK_K * TILES_PER_SPLIT)
    part = torch.empty(splits, m, wp, dtype=torch.float32, device=x.device)  # (on the current stream's pool)
    stream = None
    if x.is_cuda:
        stream = _streams.setdefault(x.device, torch.cuda.Stream(x.device))
        stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _shrink[(grid, splits)](x, a, perm, chunks, part, m, k, x.stride(0), width, TILES_PER_SPLIT,
                                WP=wp, BM=BLOCK_M, BK=BLOCK_K, PREC=_precision(a.dtype))
    return Shrunk(part, splits, stream)


def expand(shrunk: Shrunk, bt: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, chunks: torch.Tensor,
           grid: int, width: int) -> None:
    """y [M, N] += the shrink's sums times each row's slot's B (bt: B transposed, [slots * width, N]), in
    place, on the current stream once the shrink is done."""
    m, n = y.shape
    assert y.stride(1) == 1 and bt.shape[1] == n and shrunk.part.shape[1] == m
    if shrunk.stream is not None:
        torch.cuda.current_stream(y.device).wait_stream(shrunk.stream)
    _expand[(grid, triton.cdiv(n, BLOCK_N))](shrunk.part, bt, perm, chunks, y, m, n, y.stride(0), width,
                                             shrunk.splits, WP=shrunk.part.shape[2], BM=BLOCK_M, BN=BLOCK_N,
                                             PREC=_precision(bt.dtype))

