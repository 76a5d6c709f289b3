"""torch-facing wrappers of the float32 layer operations in layer_ops.c (the CPU fast path):
RMSNorm with the residual add, rotary embedding in place, the KV-cache write and decode
attention over the paged cache. Callers check `available` once."""
from __future__ import annotations

import torch

from pocketllm.kernels.cpu.build import load_cpu_kernels


def available() -> bool:
    return load_cpu_kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x [.., dim] by `weight` (float32, contiguous); with `residual`, x + residual is
    normalized and written into `residual`, and (normed, residual) returned."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    res = 0
    if residual is not None:
        assert residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape
        res = residual.data_ptr()
    load_cpu_kernels().cpu_rms_norm(x.data_ptr(), res, weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim,
                                    eps, torch.get_num_threads())
    return y if residual is None else (y, residual)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D] (heads contiguous, rows at any stride) in place; cos/sin [len, D / 2]."""
    t, h, d = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == d
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    load_cpu_kernels().cpu_rotary(x.data_ptr(), t, h, d, x.stride(0), positions.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr())
    return x


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (rows at any stride, the same for both) into the caches' slots."""
    t, h, d = k.shape
    assert k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == d and k.dtype == torch.float32
    assert k_cache.dtype == torch.float32 and slots.dtype == torch.int64 and slots.is_contiguous()
    load_cpu_kernels().cpu_write_kv(k.data_ptr(), v.data_ptr(), t, k.stride(0), h * d, slots.data_ptr(),
                                    k_cache.data_ptr(), v_cache.data_ptr())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q [n, Hq, D] (one token per request) over caches [blocks, bs, Hkv, D] -> [n, Hq, D]."""
    n, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == d and q.dtype == k_cache.dtype == torch.float32
    assert tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
    out = torch.empty(n, hq, d)
    rc = load_cpu_kernels().cpu_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), bs, hkv, d, hq, tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), n, scale, window or 0, softcap or 0.0, out.data_ptr(),
        torch.get_num_threads())
    assert rc == 0, "decode attention: out of memory"
    return out
