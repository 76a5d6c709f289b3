"""Block-scaled FP8 weights multiplied where they are kept (quant/fp8.py: e4m3 values, one float32 scale a
tile of `br` x `bc`): y [M, N] = x [M, K] @ (values * scale).T.

Each weight tile is read as FP8 (half the bytes of bfloat16: what decode, reading every weight once a step,
is bound by) and widened to x's dtype (exact: e4m3 values are bfloat16 and float16 values); the tensor cores
multiply it by x, and each tile's float32 sum times its scale is added to the float32 result. A program's
tile lies in one scale tile (tile sizes divide the scale block's), so the scale is one number a step, read
once, not a gathered one a weight. The product is the dequantized weight's up to float32 rounding (in
float32 within it; in bfloat16 closer than the dequantized bfloat16 weight's, which rounds each weight).

Decode rows of bfloat16 or float16 activations go to the CUDA C GEMV (``cuda/dense_gemv.cu`` with FP8=1;
``kernels/dispatch.py``'s FP8 table says which rows): a row's product streams the weights at memory speed
there, which tensor-core tiles of 16 rows do not.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.kernels.cuda import dense_gemv
from pocketllm.kernels.dispatch import gpu_fp8_kernel


@triton.jit
def _fp8_matmul(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_y, stride_s,
                BR: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr):
    pid_n = tl.program_id(1)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = offs_m < M, offs_n < N
    s_row = s_ptr + (pid_n * BN // BR) * stride_s  # BR % BN == 0: the program's rows share a scale row
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        scale = tl.load(s_row + k0 // BC)  # BC % BK == 0: one scale a step
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PREC) * scale
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tiles(m: int, block: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) for M rows: decode rows take narrow column blocks (many programs, each
    streaming its weights), prompt rows square tiles; BN and BK divide the scale block's rows and columns."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 32, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    return bm, _divisor(bn, block[0]), _divisor(bk, block[1]), warps, stages


def _divisor(t: int, b: int) -> int:
    """The largest power of two up to t that divides b (b a multiple of 16: Fp8Blocks.of checks)."""
    while b % t:
        t //= 2
    return t


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype: the product is in it) @ the weight [N, K] held as `values` (float8 e4m3)
    and `scale` (its scale_inv: [ceil(N / br), ceil(K / bc)] float32, contiguous; `block` = (br, bc)), plus
    `bias`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    if gpu_fp8_kernel(x.shape[0], x.dtype, cuda_gemv=dense_gemv.fp8_usable(x, values, scale, block)) == "cuda_gemv":
        y = dense_gemv.fp8_linear(x, values, scale, block, bias)
        if y is not None:  # (None: NVRTC could not build it here)
            return y
    return fp8_tiled(x, values, scale, block, bias)


def fp8_tiled(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_matmul``'s product on the Triton tiles (x rows contiguous, float32 scales)."""
    m, k = x.shape
    n = values.shape[0]
    assert values.shape[1] == k and values.is_contiguous() and scale.shape == (-(-n // block[0]), -(-k // block[1]))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = tiles(m, block)
    if m:
        _fp8_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, values, scale, y, m, n, k, x.stride(0), y.stride(0), scale.stride(0), BR=block[0], BC=block[1],
            BM=bm, BN=bn, BK=bk, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            num_stages=stages)
    return y if bias is None else y + bias
