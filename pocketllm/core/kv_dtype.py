"""What the KV cache holds (`--kv-cache-dtype`, vLLM's flag): "auto" keeps keys and values in the
model's dtype; "int8" and "fp8" (e4m3) keep each token's head (head_dim values) as 8-bit values
and one float32 scale, its largest magnitude over the format's (127, 448): llama.cpp's q8_0 takes
a scale per 32 values, vLLM's fp8 per tensor or per head; a scale per token and head is as close
as q8_0 at head_dim 64 and needs no calibration.

The scales sit beside the values in the one block pool: a layer's K (and V) cache is
[blocks, block_size, kv_heads, head_dim] values and [blocks, block_size, kv_heads] scales, both
indexed by the same block ids, so prefix caching, preemption and sliding-window groups see blocks
as before. Attention reads the 8-bit values and multiplies by the scales inside the kernel: a
score by its key's scale, a softmax weight by its value's scale."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVQuant:
    name: str
    storage: torch.dtype
    qmax: float  # the format's largest magnitude: a head's largest value maps to it


QUANTS = {"int8": KVQuant("int8", torch.int8, 127.0), "fp8": KVQuant("fp8", torch.float8_e4m3fn, 448.0)}


def kv_quant(kv_cache_dtype: str) -> KVQuant | None:
    return QUANTS.get(kv_cache_dtype)


def quant_of(storage: torch.dtype) -> KVQuant:
    return next(q for q in QUANTS.values() if q.storage == storage)


def value_bytes(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one cached value takes, its share of the head's scale included."""
    q = kv_quant(kv_cache_dtype)
    if q is None:
        return torch.empty((), dtype=model_dtype).element_size()
    return 1 + 4 / head_dim


def quantize(x: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values in quant.storage, float32 scales [...]): the reference the kernels
    follow (float32 arithmetic: scale = amax / qmax, values = x * (1 / scale), int8 rounded to the
    nearest even)."""
    x = x.float()
    scale = x.abs().amax(-1) / quant.qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = x * inv.unsqueeze(-1)
    if quant.storage == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-quant.qmax, quant.qmax).to(quant.storage), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
