"""What a loaded model holds on a device."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from pocketllm.layers.linear import QuantizedTensor


def _tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors an attribute of a module holds: GGUF layers keep theirs in plain attributes."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, QuantizedTensor):
        yield value.data
    elif callable(getattr(value, "tensors", None)):  # the CPU layouts of GGUF blocks
        yield from value.tensors()


def weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters, buffers and GGUF blocks on ``device``; memory shared by
    several (tied embeddings, views of one file) is counted once.  Off the CPU, host-side views of
    the file (a table's GGUF source kept for a tied output layer) are not weights held there."""
    held: dict[tuple, int] = {}
    for m in model.modules():
        for value in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            for t in _tensors_in(value):
                if t.device.type == device.type:
                    key = (t.device, t.data_ptr())
                    held[key] = max(held.get(key, 0), t.numel() * t.element_size())
    return sum(held.values())
