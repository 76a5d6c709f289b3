"""LoRA adapters on the model's Linear layers: many adapters in one step, each row its own.

A targeted layer holds `max_loras` slots of adapter weights: A [slots * parts * r, in] and B, kept
transposed, [slots * parts * r, out], r the largest rank allowed. A fused layer (QKV, gate/up) takes one adapter
per part: part i's A rows in a slot are i * r .. i * r + rank_i, its B block is those columns of its
own output rows, zeros elsewhere, so one pair of products gives every part its own adapter (the zeros
add exactly nothing). The scaling (alpha / rank, or alpha / sqrt(rank) for rsLoRA) is folded into B.

A step's rows each run the adapter of their request's slot (or none). Each layer multiplies every row
by every slot's A at once (one product: slots * parts * r columns, small beside the layer's own), keeps
each row's own slot's columns (`LoRARows.mask`, made once a step), and adds that times B to its base
output: three operations a layer whatever the mix of adapters, after the base product (dense or
quantized, unchanged). A step without adapter rows does none of it."""
from __future__ import annotations

import contextlib

import torch


class LoRARows:
    """Each row's slot for the step (`slots`, int64 on the host, -1 for none: the CPU's one-call decoder
    reads them) and the same as a [rows, slots, 1] mask of ones and zeros on the device (the layers');
    both None when no row has an adapter. Set by the runner before each forward."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    def set(self, slots: list[int], device: torch.device) -> None:
        """`slots`: each row's slot, -1 for a row without an adapter."""
        self._cast = {}
        if all(s < 0 for s in slots):
            self.slots = self.mask = None
            return
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.mask = (self.slots[:, None] == torch.arange(self.max_loras)[None, :]).float()[:, :, None].to(device)

    @contextlib.contextmanager
    def after(self, n: int):
        """Within: the rows from `n` on (a step's prompt chunks, run apart from its decode rows)."""
        slots, mask = self.slots, self.mask
        if mask is not None:
            self.slots, self.mask, self._cast = slots[n:], mask[n:], {}
        try:
            yield
        finally:
            self.slots, self.mask, self._cast = slots, mask, {}

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.mask.to(dtype)
        return self._cast[dtype]


class LoRASlots:
    """One layer's adapter slots (see the module's docs)."""

    def __init__(self, in_features: int, out_sizes: list[int], rows: LoRARows, max_rank: int, dtype, device):
        self.out_sizes, self.max_rank, self.rows = list(out_sizes), max_rank, rows
        self.width = len(out_sizes) * max_rank  # a slot's columns
        slots = rows.max_loras
        self.a = torch.zeros(slots * self.width, in_features, dtype=dtype, device=device)
        # (B transposed: the CPU's one-call decoder adds its rows to a token's outputs, contiguous)
        self.bt = torch.zeros(slots * self.width, sum(out_sizes), dtype=dtype, device=device)

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s adapter into `slot`: a [rank, in], b [out_part, rank] (scaled already)."""
        rank = a.shape[0]
        assert rank <= self.max_rank and b.shape == (self.out_sizes[part], rank), (a.shape, b.shape)
        lo, col = sum(self.out_sizes[:part]), slot * self.width + part * self.max_rank
        self.a[col:col + rank] = a
        self.bt[col:col + rank, lo:lo + b.shape[0]] = b.T

    def clear(self, slot: int) -> None:
        self.a[slot * self.width:(slot + 1) * self.width].zero_()
        self.bt[slot * self.width:(slot + 1) * self.width].zero_()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter product (x, y: [rows, in], [rows, out])."""
        if self.rows.mask is None:
            return y
        xa = (x.to(self.a.dtype) @ self.a.T).view(x.shape[0], -1, self.width) * self.rows.mask_as(self.a.dtype)
        return y + (xa.view(x.shape[0], -1) @ self.bt).to(y.dtype)
