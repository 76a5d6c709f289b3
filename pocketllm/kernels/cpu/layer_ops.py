"""torch-facing wrappers of the float32 layer operations in layer_ops.c (the CPU fast path):
RMSNorm with the residual add, rotary embedding in place, the KV-cache write, decode attention
over the paged cache (with the rotary and the write fused in on decode-only steps) and gated
activations. Callers check `available` once."""
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


def _scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, int]:
    """The scale pointers of an 8-bit (int8) cache, 0 for a float32 one."""
    if k_scale is None:
        assert k_cache.dtype == torch.float32
        return 0, 0
    assert k_cache.dtype == torch.int8 and k_cache.is_contiguous()
    for s in (k_scale, v_scale):
        assert s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:3]
    return k_scale.data_ptr(), v_scale.data_ptr()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] (rows at any stride) into the caches' slots (quantized, with scales: an 8-bit cache)."""
    t, h, d = k.shape
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == d and x.dtype == torch.float32
    assert slots.dtype == torch.int64 and slots.is_contiguous()
    load_cpu_kernels().cpu_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, h, d,
                                    slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    *_scales(k_cache, k_scale, v_scale))


def gather_int8_blocks(cache: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` of an int8 cache [blocks, bs, Hkv, D] dequantized by its scales [blocks, bs, Hkv] into
    float32 [len(ids), bs, Hkv, D], in one pass (what torch does in three)."""
    _, bs, hkv, d = cache.shape
    assert cache.dtype == torch.int8 and cache.is_contiguous() and scales.is_contiguous()
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), bs, hkv, d)
    load_cpu_kernels().cpu_gather_int8_blocks(cache.data_ptr(), scales.data_ptr(), ids.data_ptr(), ids.numel(), bs,
                                              hkv, d, out.data_ptr(), torch.get_num_threads())
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] (one token per request, already in the cache) over caches [blocks, bs, Hkv, D]
    -> [n, Hq, D]. `sinks`: float32 [Hq], a logit per head in each softmax (gpt-oss). `k_scale` and
    `v_scale` [blocks, bs, Hkv]: the caches are int8 (pocketllm.core.kv_dtype)."""
    return _decode_attention(q, q.shape[1], k_cache, v_cache, tables, lens, scale, window, softcap, sinks,
                             scales=(k_scale, v_scale))


def fused_decode_attention(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                           window: int | None, softcap: float | None,
                           rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                           sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A decode-only step in one call: qkv [n, Hq + 2 Hkv, D] has its queries and keys rotated in
    place (`rotary` = (positions, cos, sin) tables, if given), keys and values written to `slots`,
    then each query attends its paged context -> [n, Hq, D]."""
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == qkv.shape[0]
    if rotary is not None:
        assert rotary[0].dtype == torch.int64 and rotary[0].is_contiguous()
    return _decode_attention(qkv, num_heads, k_cache, v_cache, tables, lens, scale, window, softcap, sinks, slots,
                             rotary, (k_scale, v_scale))


def _decode_attention(qkv, hq, k_cache, v_cache, tables, lens, scale, window, softcap, sinks=None, slots=None,
                      rotary=None, scales=(None, None)):
    n, _, d = qkv.shape
    _, bs, hkv, _ = k_cache.shape
    assert qkv.stride(2) == 1 and qkv.stride(1) == d and qkv.dtype == torch.float32
    ks, vs = _scales(k_cache, *scales)
    assert tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
    out = torch.empty(n, hq, d)
    pos, cos, sin = (p.data_ptr() for p in rotary) if rotary is not None else (0, 0, 0)
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == hq
    rc = load_cpu_kernels().cpu_decode_attention(
        qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, bs, hkv, d, hq, tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), n, scale, window or 0, softcap or 0.0,
        0 if sinks is None else sinks.data_ptr(), out.data_ptr(),
        0 if slots is None else slots.data_ptr(), pos, cos, sin, torch.get_num_threads())
    assert rc == 0, "decode attention: out of memory"
    return out


def gated_act(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """act(gate) * up of gate_up [.., 2 I] (gate first) -> [.., I]; `act` 0: SiLU, 1: GELU with the
    tanh approximation (the Triton kernels' codes)."""
    assert gate_up.dtype == torch.float32 and gate_up.is_contiguous()
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    load_cpu_kernels().cpu_gated_act(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, act, out.data_ptr(),
                                     torch.get_num_threads())
    return out


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of gate_up [.., 2 I] (gate first) -> [.., I]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    assert gate_up.dtype == torch.float32 and gate_up.is_contiguous()
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    load_cpu_kernels().cpu_clamped_swiglu(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, alpha, limit,
                                          out.data_ptr(), torch.get_num_threads())
    return out
