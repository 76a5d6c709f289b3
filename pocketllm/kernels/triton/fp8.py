"""Block-scaled FP8 weights multiplied where they are kept (quant/fp8.py: e4m3 values, one float32 scale a
tile of `br` x `bc`): y [M, N] = x [M, K] @ (values * scale).T.

Each weight tile is read as FP8 (half the bytes of bfloat16: what decode, reading every weight once a step,
is bound by), widened to float32, times its tile's scale (exact: a 4-bit significand times a float32),
rounded once to x's dtype (the bits a dequantized copy holds) and multiplied on the tensor cores in that
dtype, accumulated in float32. So the product is the dequantized weight's, without the dequantized weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_matmul(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_y, stride_s,
                BR: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        scale = tl.load(s_ptr + (offs_n // BR)[:, None] * stride_s + (offs_k // BC)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = (w.to(tl.float32) * scale).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) for M rows: decode rows take narrow column blocks (many programs, each
    streaming its weights), prompt rows square tiles."""
    if m <= 16:
        return 16, 32, 128, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 3
    return 128, 128, 64, 8, 3


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype: the product is in it) @ the weight [N, K] held as `values` (float8 e4m3)
    and `scale_inv` ([ceil(N / br), ceil(K / bc)] float32; `block` = (br, bc)), plus `bias`."""
    m, k = x.shape
    n = values.shape[0]
    assert values.shape[1] == k and values.is_contiguous() and scale_inv.shape == (-(-n // block[0]), -(-k // block[1]))
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = tiles(m)
    scale = scale_inv.float().contiguous()
    if m:
        _fp8_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, values, scale, y, m, n, k, x.stride(0), y.stride(0), scale.stride(0), BR=block[0], BC=block[1],
            BM=bm, BN=bn, BK=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            num_stages=stages)
    return y if bias is None else y + bias
