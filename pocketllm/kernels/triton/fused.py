"""Fused element-wise kernels of the decoder layer: RMSNorm (with the residual add), rotary
embedding applied in place, and the gated activations. Each computes in float32 and rounds
once, where torch would round after every op; the torch versions in pocketllm.layers are the
reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_act import attach, buffers_for, kernel_args, store_groups


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, xq_ptr, xd_ptr, xs_ptr, stride_q, stride_d,
                     stride_x, stride_r, stride_o, stride_ro, n, eps, offset, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, INT8: tl.constexpr):
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
    y = (xf * inv * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if INT8:
        store_groups(y.to(tl.float32), xq_ptr, xd_ptr, xs_ptr, row, 0, n, stride_q, stride_d, BLOCK)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             residual: torch.Tensor | None = None, int8_rows: int = 0):
    """RMSNorm over the last dim of a 2-D x; with `residual`, normalises x + residual and also
    returns that sum (the next residual).  Up to ``int8_rows`` rows the output also carries its
    8-bit form (``int8_act``) for the GGUF GEMVs that read it."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    q = buffers_for(out, int8_rows)
    block = triton.next_power_of_2(n)
    # one program a row: at 4096 features 16 warps take 1.8 us (2.5 with the 8-bit form), 4 take
    # 1.9 (3.2) on the H200 (benchmarks/results/h200-norm-warps.txt)
    _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, *kernel_args(q, out), x2.stride(0), res2.stride(0),
                              out.stride(0), res_out.stride(0), n, eps, offset,
                              HAS_RES=residual is not None, BLOCK=block, INT8=q is not None,
                              num_warps=min(16, max(4, block // 256)))
    out = out.view(shape) if q is None else attach(out.view(shape), q)
    return out if residual is None else (out, res_out.view(shape))


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                   stride_t, stride_h, stride_cos, stride_vt, stride_kcs, stride_vcs, num_heads, num_q_heads, eps,
                   offset, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                   WRITE_KV: tl.constexpr, V_ROW: tl.constexpr, BLOCK_V: tl.constexpr):
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
    if NORM:  # RMSNorm of each head first (query heads by qw, key heads by kw), rounded as stored
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))[:, None] / (2 * HALF) + eps)
        is_q = h[:, None] < num_q_heads
        w1 = tl.where(is_q, tl.load(qw_ptr + i, mask=i < HALF, other=0.0)[None, :],
                      tl.load(kw_ptr + i, mask=i < HALF, other=0.0)[None, :]).to(tl.float32) + offset
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i, mask=i < HALF, other=0.0)[None, :],
                      tl.load(kw_ptr + HALF + i, mask=i < HALF, other=0.0)[None, :]).to(tl.float32) + offset
        x1 = (x1 * inv * w1).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv * w2).to(x_ptr.dtype.element_ty).to(tl.float32)
    y1 = (x1 * c - x2 * s).to(x_ptr.dtype.element_ty)
    y2 = (x2 * c + x1 * s).to(x_ptr.dtype.element_ty)
    tl.store(base, y1, mask=ok)
    tl.store(base + HALF, y2, mask=ok)
    if WRITE_KV:  # the step's keys (rotated) and values into the cache, as write_kv would
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # (-1: a padding row of a captured batch)
            is_k = ok & (h[:, None] >= num_q_heads)
            kb = kc_ptr + slot * stride_kcs + (h[:, None] - num_q_heads) * (2 * HALF) + i[None, :]
            tl.store(kb, y1, mask=is_k)
            tl.store(kb + HALF, y2, mask=is_k)
            if tl.program_id(1) == 0:  # the row's values, once
                j = tl.arange(0, BLOCK_V)
                tl.store(vc_ptr + slot * stride_vcs + j, tl.load(v_ptr + t * stride_vt + j, mask=j < V_ROW),
                         mask=j < V_ROW)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            norms: tuple[torch.Tensor, torch.Tensor, int, float, float] | None = None,
            kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half layout) in place; cos/sin [max_len, D/2] float32 tables.
    ``norms`` = (q weight, k weight, query heads, eps, offset): each head RMS-normalized first
    (Qwen3's and Gemma 3's q/k norms: the first heads by the q weight, the rest by the k one).
    ``kv`` = (v [T, Hkv, D], k_cache, v_cache, slot_mapping [T]): x's last Hkv heads are the keys, and
    the kernel also writes them (rotated) and v to each row's cache slot, as ``attention.write_kv``
    does, saving its launch (slot -1 is skipped)."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    block_h = min(triton.next_power_of_2(h), 16)
    qw, kw, hq, eps, offset = norms if norms is not None else (cos, cos, h, 0.0, 0.0)
    v, k_cache, v_cache, slots = kv if kv is not None else (x, x, x, positions)
    v_row = v.shape[1] * d if kv is not None else 1
    if kv is not None:
        hkv = v.shape[1]
        hq = h - hkv if norms is None else hq
        assert hq == h - hkv and k_cache.shape[2:] == v_cache.shape[2:] == (hkv, d), (h, hkv, k_cache.shape)
        assert v.stride(1) == d and v.stride(2) == 1 and k_cache.dtype == v_cache.dtype == x.dtype == v.dtype
        assert k_cache.stride(2) == d and k_cache.stride(3) == 1 and v_cache.stride(2) == d and v_cache.stride(3) == 1
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x, positions, cos, sin, qw, kw, v, k_cache, v_cache, slots, x.stride(0), x.stride(1), cos.stride(0),
        v.stride(0), k_cache.stride(1), v_cache.stride(1), h, hq, eps, offset, HALF=d // 2, BLOCK_H=block_h,
        BLOCK=triton.next_power_of_2(d // 2), NORM=norms is not None, WRITE_KV=kv is not None, V_ROW=v_row,
        BLOCK_V=triton.next_power_of_2(v_row))
    return x


# activation codes; CLAMPED_SWIGLU: gpt-oss's (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
# up clamped to [-limit, limit]
SILU, GELU_TANH, GELU, CLAMPED_SWIGLU = 0, 1, 2, 3


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, bias_ptr, ids_ptr, xq_ptr, xd_ptr, xs_ptr, stride_q, stride_d, stride_x,
                      stride_o, stride_b, n, alpha, limit, ACT: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_BIAS: tl.constexpr, INT8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:  # row's expert's bias, [gate | up] as x
        b = bias_ptr + tl.load(ids_ptr + row) * stride_b + cols
        g += tl.load(b, mask=ok, other=0.0).to(tl.float32)
        u += tl.load(b + n, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACT == 2:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        g = tl.minimum(g, limit)
        a = g * tl.sigmoid(g * alpha)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
    y = (a * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if INT8:
        store_groups(y.to(tl.float32), xq_ptr, xd_ptr, xs_ptr, row, tl.program_id(1) * BLOCK, n, stride_q,
                     stride_d, BLOCK)


def gated_act(x: torch.Tensor, act: int, alpha: float = 0.0, limit: float = 0.0,
              bias: torch.Tensor | None = None, ids: torch.Tensor | None = None, int8_rows: int = 0) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> act(gate) * up [T, I] (``alpha`` and ``limit``: CLAMPED_SWIGLU's).
    With ``bias`` [E, 2I] and ``ids`` [T]: row t's gate and up get row ids[t] of ``bias`` added first
    (a mixture-of-experts layer's pairs and their experts' biases).  ``int8_rows`` as for ``rms_norm``."""
    t, n2 = x.shape
    n = n2 // 2
    assert x.stride(1) == 1 and (bias is None or (bias.shape[1] == n2 and bias.stride(1) == 1 and ids is not None))
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = max(min(triton.next_power_of_2(n), 1024), 32)
    q = buffers_for(out, int8_rows)
    _gated_act_kernel[(t, triton.cdiv(n, block))](x, out, x if bias is None else bias, x if ids is None else ids,
                                                  *kernel_args(q, out), x.stride(0), out.stride(0),
                                                  0 if bias is None else bias.stride(0), n, alpha, limit, ACT=act,
                                                  BLOCK=block, HAS_BIAS=bias is not None, INT8=q is not None)
    return out if q is None else attach(out, q)
