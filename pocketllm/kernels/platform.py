"""Which kernels a model's layers run: chosen once, before the model is built.

Models and layers name operations (a norm, a rotary embedding, an attention, an activation); each
module reads the configuration when it is constructed (`kernels_for`) and keeps it, so that no
layer asks a tensor which device it is on and nothing is switched on after loading. The loader
builds the model inside `building_with(KernelConfig.choose(...))`; a module built outside one (a
test's single layer) gets its device's plain configuration.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

# Devices that run the GPU's kernels. Tests add "cpu" to run them on CPU tensors under Triton's
# interpreter (TRITON_INTERPRET=1).
TRITON_DEVICES = {"cuda"}


@dataclass(frozen=True)
class KernelConfig:
    # The GPU's kernels: Triton's (and CUDA C where NVRTC builds it) for norms, rotary embeddings,
    # activations, routing and the grouped expert GEMVs.
    gpu: bool = False
    # The CPU fast path's C kernels (kernels/cpu/layer_ops.py): fused norms, rotary embeddings and
    # activations in place, the cache write and decode attention, a decode step's layers in one call.
    # float32 on one rank only: the fused layers hold whole matrices.
    cpu_fused: bool = False
    # GGUF layers: passes of 8-bit activations on the CPU's integer kernels (0: the exact product;
    # kernels.dispatch.int8_passes), and weights dequantized once at load instead of kept in blocks.
    int8_passes: int = 0
    dequantize_at_load: bool = False

    def __post_init__(self):
        assert not (self.gpu and self.cpu_fused), "one platform's kernels"
        assert self.int8_passes in (0, 1, 2), self.int8_passes

    @classmethod
    def choose(cls, device: torch.device, dtype: torch.dtype, *, exact_kernels: bool, tp_size: int) -> KernelConfig:
        if device.type in TRITON_DEVICES:
            return cls(gpu=True)
        return cls.host(exact_kernels=exact_kernels or dtype != torch.float32 or tp_size != 1)

    @classmethod
    def host(cls, *, exact_kernels: bool) -> KernelConfig:
        """The CPU's own kernels, in float32 (what host memory's experts run, beside a GPU's model)."""
        if exact_kernels:
            return cls()
        from pocketllm.kernels.cpu import layer_ops

        return cls(cpu_fused=layer_ops.available())

    @classmethod
    def plain(cls, device: torch.device | str) -> KernelConfig:
        """A device's configuration without the CPU fast path."""
        return cls(gpu=torch.device(device).type in TRITON_DEVICES)


_building: ContextVar[KernelConfig | None] = ContextVar("pocketllm_kernels", default=None)


@contextlib.contextmanager
def building_with(config: KernelConfig) -> Iterator[KernelConfig]:
    """Modules constructed inside run `config`'s kernels."""
    token = _building.set(config)
    try:
        yield config
    finally:
        _building.reset(token)


def kernels_for(device: torch.device | str) -> KernelConfig:
    """The kernels of the model being built on `device` (its plain ones outside `building_with`)."""
    config = _building.get()
    return KernelConfig.plain(device) if config is None else config


def staged_for(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` in page-locked memory where copies from it go to a CUDA `device` (queued behind the device's
    work, the host not waiting), else itself."""
    return host.pin_memory() if device.type == "cuda" else host
