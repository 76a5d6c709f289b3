"""A K-split product's partial sums added in order, cast to the output's dtype and biased, in one launch
(a torch sum over the splits and a cast are two launches and an extra float32 pass)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["MN"])
def _sum_kernel(part_ptr, bias_ptr, y_ptr, MN, N, S: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = sum of the S splits in order (+ bias), in y's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def sum_splits(part: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """part float32 [S, M, N] (contiguous) -> [M, N] of ``dtype``: split 0 + split 1 + ... (+ ``bias`` [N])."""
    s, m, n = part.shape
    assert part.dtype == torch.float32 and part.is_contiguous() and (bias is None or bias.shape == (n,))
    y = torch.empty((m, n), dtype=dtype, device=part.device)
    if m * n:
        _sum_kernel[(triton.cdiv(m * n, BLOCK),)](part, y if bias is None else bias, y, m * n, n, S=s, BLOCK=BLOCK,
                                                 HAS_BIAS=bias is not None)
    return y
