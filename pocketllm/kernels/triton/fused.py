"""Fused element-wise kernels of the decoder layer: RMSNorm (with the residual add), rotary
embedding applied in place, and the gated activations. Each computes in float32 and rounds
once, where torch would round after every op; the torch versions in pocketllm.layers are the
reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, n, eps, offset, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        # The sum is rounded to the activation dtype first, as the unfused `x + residual` is.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) + offset
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of a 2-D x; with `residual`, normalises x + residual and also
    returns that sum (the next residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0),
                              res_out.stride(0), n, eps, offset, HAS_RES=residual is not None,
                              BLOCK=triton.next_power_of_2(n))
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BLOCK)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (h[:, None] < num_heads) & (i[None, :] < HALF)
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(base + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=ok)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half layout) in place; cos/sin [max_len, D/2] float32 tables."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    block_h = min(triton.next_power_of_2(h), 16)
    _rotary_kernel[(t, triton.cdiv(h, block_h))](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                                 h, HALF=d // 2, BLOCK_H=block_h,
                                                 BLOCK=triton.next_power_of_2(d // 2))
    return x


# activation codes
SILU, GELU_TANH, GELU = 0, 1, 2


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, stride_x, stride_o, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


def gated_act(x: torch.Tensor, act: int) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> act(gate) * up [T, I]."""
    t, n2 = x.shape
    n = n2 // 2
    assert x.stride(1) == 1
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _gated_act_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, ACT=act, BLOCK=block)
    return out
