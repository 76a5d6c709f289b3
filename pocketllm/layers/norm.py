from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.kernels.platform import kernels_for


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32. `offset=1` gives Gemma's x * (1 + w) form."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.offset = offset
        self._scale: torch.Tensor | None = None
        self.kernels = kernels_for(device)  # the CPU fast path's kernel updates the residual in place
        self.int8_rows = 0  # CUDA: up to this many rows the output carries its 8-bit form (int8_act)

    def load(self, tensor: torch.Tensor, shard: int = 0, kind: str = "weight") -> None:
        self.weight.data.copy_(tensor)
        self._scale = None

    def scale(self) -> torch.Tensor:
        if self._scale is None:
            self._scale = (self.weight.float() + self.offset)
        return self._scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual)."""
        if self.kernels.gpu:
            from pocketllm.kernels.triton.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, self.offset, residual, self.int8_rows)
        if self.kernels.cpu_fused and x.is_contiguous():
            from pocketllm.kernels.cpu import layer_ops

            return layer_ops.rms_norm(x, self.scale(), self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        y = F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)
        return y if residual is None else (y, residual)


class LayerNorm(torch.nn.Module):
    """LayerNorm with weight and bias, computed in float32 (BERT's post-norm blocks)."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def load(self, tensor: torch.Tensor, shard: int = 0, kind: str = "weight") -> None:
        getattr(self, kind).data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
