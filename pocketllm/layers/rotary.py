"""Rotary position embeddings (rotate-half layout), with the scaling variants the families use."""
from __future__ import annotations

import math

import torch

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.kernels.platform import kernels_for

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "freq_factors", "yarn")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "yarn":
        # YaRN (arXiv 2309.00071) as transformers computes it: interpolated frequencies below the
        # correction range, the original ones above it, a linear ramp between (over head_dim / 2)
        factor, base = float(scaling["factor"]), float(theta)
        old_len = float(scaling["original_max_position_embeddings"])

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
            return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        extrapolate = 1 - ramp
        # divided as transformers divides (1 / (factor * p), not inv_freq / factor): the same bits
        pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        return 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    raise UnsupportedFeatureError(
        f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_SCALING)}")


def attention_scaling(scaling: dict | None) -> float:
    """What the cos/sin tables are multiplied by: YaRN's attention factor (given, or from the
    scaling factor and DeepSeek's mscale pair); 1 for the other kinds."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables computed once for every position up to max_len, indexed per token."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        scale = attention_scaling(scaling)
        # Tables in float32: positions beyond a few thousand lose precision in bf16.
        self.register_buffer("cos", (freqs.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device), persistent=False)

        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.kernels = kernels_for(device)  # on the GPU and the CPU fast path: rotated in place

    def forward(self, positions: torch.Tensor, x: torch.Tensor, norms: tuple | None = None,
                kv: tuple | None = None) -> torch.Tensor:
        """x [T, H, D]: queries and keys of all heads at once. On CUDA and on the CPU fast path x
        is rotated in place; on CUDA ``norms`` (see ``kernels.triton.fused.rotary_``) RMS-normalizes
        each head first. ``kv`` (the attention kernels' path): the rotary kernel also writes the keys
        and values to the cache (``rotary_``'s)."""
        if self.kernels.gpu or kv is not None:
            from pocketllm.kernels.triton.fused import rotary_

            return rotary_(x, positions, self.cos, self.sin, norms, kv)
        assert norms is None, "q/k norms in the rotary kernel: CUDA only"
        if self.kernels.cpu_fused:
            from pocketllm.kernels.cpu import layer_ops

            return layer_ops.rotary_(x, positions, self.cos, self.sin)
        cached = self._cached
        if cached is None or cached[0] is not positions:
            # Every layer of a step passes the same positions tensor: gather the tables once.
            cached = self._cached = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return _rotate(x, cached[1], cached[2])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
