"""Activations quantized to 8 bits for the GGUF GEMVs (``gguf_q8.py``): int8 in blocks of 32 with
a float scale ``xd = max|x| / 127`` and the scaled sum ``xs = xd * sum(q)`` (llama.cpp's
``block_q8_1``).

The kernels that produce a GEMV's input (RMSNorm and the gated activation in ``fused.py``,
attention's split merge) can write this form beside their output, in the same launch, and attach it to the output tensor; the GEMV
then takes it instead of quantizing again (one launch less per projection: ~1.2 us each on the
H200, 161 of them a token for an 8B Q4_K_M model).  Every producer quantizes with the one
``quantize_groups``, so the attached form is bit for bit what ``quantize_activations`` gives.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Int8Activations(NamedTuple):
    xq: torch.Tensor  # int8 [M, K]
    xd: torch.Tensor  # float32 [M, K / 32]: each block's scale
    xs: torch.Tensor  # float32 [M, K / 32]: scale * sum of the block's q

    @staticmethod
    def empty(m: int, k: int, device) -> Int8Activations:
        xd = torch.empty((m, k // 32), dtype=torch.float32, device=device)
        return Int8Activations(torch.empty((m, k), dtype=torch.int8, device=device), xd, torch.empty_like(xd))


@triton.jit
def quantize_groups(x):
    """x float32 [G, 32] -> (q as float [G, 32], d [G, 1], d * sum(q) [G, 1])."""
    d = tl.max(tl.abs(x), axis=1, keep_dims=True) / 127.0
    v = x / tl.where(d > 0, d, 1.0)
    q = tl.where(v < 0, -tl.floor(0.5 - v), tl.floor(v + 0.5))  # round half away from zero
    return q, d, d * tl.sum(q, axis=1, keep_dims=True)


@triton.jit
def store_groups(x, xq_ptr, xd_ptr, xs_ptr, row, col0, n, stride_q, stride_d, BLOCK: tl.constexpr):
    """Quantize x (float32 [BLOCK], columns col0 .. col0 + BLOCK of row ``row``; col0 a multiple
    of 32) and store the groups below column n."""
    q, d, s = quantize_groups(tl.reshape(x, (BLOCK // 32, 32)))
    g = col0 // 32 + tl.arange(0, BLOCK // 32)[:, None]
    cols = g * 32 + tl.arange(0, 32)[None, :]
    tl.store(xq_ptr + row * stride_q + cols, q.to(tl.int8), mask=cols < n)
    tl.store(xd_ptr + row * stride_d + g, d, mask=g * 32 < n)
    tl.store(xs_ptr + row * stride_d + g, s, mask=g * 32 < n)


@triton.jit
def _quantize_kernel(x_ptr, xq_ptr, xd_ptr, xs_ptr, n, stride_xm, stride_xq, stride_xd, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + m * stride_xm + cols, mask=cols < n, other=0.0).to(tl.float32)
    store_groups(x, xq_ptr, xd_ptr, xs_ptr, m, col0, n, stride_xq, stride_xd, BLOCK)


_QUANT_BLOCK = 512


def quantize_activations(x: torch.Tensor) -> Int8Activations:
    """x [M, K] (K a multiple of 32, rows contiguous) in 8 bits."""
    m, k = x.shape
    assert k % 32 == 0 and x.stride(1) == 1
    out = Int8Activations.empty(m, k, x.device)
    if m:
        _quantize_kernel[(m, triton.cdiv(k, _QUANT_BLOCK))](x, *out, k, x.stride(0), out.xq.stride(0),
                                                           out.xd.stride(0), BLOCK=_QUANT_BLOCK, num_warps=2)
    return out


def wanted(x: torch.Tensor, rows: int) -> bool:
    """Whether a producer of x's shape [M, K] writes the 8-bit form: M <= ``rows`` (its consumers'
    limit, 0 where none takes it), K in whole blocks, 16-bit activations (float32 keeps the exact
    kernels)."""
    return 0 < x.shape[0] <= rows and x.shape[-1] % 32 == 0 and x.dtype in (torch.bfloat16, torch.float16)


def buffers_for(y: torch.Tensor, rows: int) -> Int8Activations | None:
    """Where a producer writes the 8-bit form of its output y ([M, K], contiguous) if ``wanted``."""
    return Int8Activations.empty(*y.shape, y.device) if wanted(y, rows) else None


def kernel_args(q: Int8Activations | None, placeholder: torch.Tensor) -> tuple:
    """A producer kernel's (xq, xd, xs, xq's row stride, xd's row stride): q's, or placeholders
    where it writes none."""
    return (placeholder,) * 3 + (0, 0) if q is None else (*q, q.xq.stride(0), q.xd.stride(0))


def attach(y: torch.Tensor, q: Int8Activations) -> torch.Tensor:
    """Mark ``q`` as the 8-bit form of ``y``: a fresh output that nothing writes in place afterwards
    (there is no checking that: in inference mode tensors keep no version counter)."""
    y._int8_activations = q
    return y


def attached(x: torch.Tensor) -> Int8Activations | None:
    """The 8-bit form a producer attached to x ([M, K] or [*, K]), if x is contiguous and its shape
    is the form's."""
    q = getattr(x, "_int8_activations", None)
    if q is None or not x.is_contiguous() or q.xq.numel() != x.numel() or q.xq.shape[-1] != x.shape[-1]:
        return None
    return q


def flattened(x: torch.Tensor) -> torch.Tensor:
    """x [T, ...] as [T, -1], keeping an 8-bit form attached to x (e.g. attention's [T, H, D] output
    for the output projection; in inference mode a view does not know its base, so the form moves
    by hand)."""
    y = x.reshape(x.shape[0], -1)
    q = getattr(x, "_int8_activations", None)
    return y if q is None or y.data_ptr() != x.data_ptr() else attach(y, q)
