"""LoRA adapters on the model's Linear layers: many adapters in one step, each row its own.

A targeted layer holds `max_loras` slots of adapter weights: A [slots, parts * r, in] and B
[slots, out, parts * r], r the largest rank allowed. A fused layer (QKV, gate/up) takes one adapter
per part: part i's A rows are i * r .. i * r + rank_i, its B block is those columns of its own output
rows, zeros elsewhere, so one pair of products gives every part its own adapter (the zeros add
exactly nothing). The scaling (alpha / rank, or alpha / sqrt(rank) for rsLoRA) is folded into B.

A step's rows each run the adapter of their request's slot (or none): `LoRARows`, set by the runner
before the forward, groups the rows by slot, and each layer adds (x[rows] @ A[slot]^T) @ B[slot]^T to
its base output for each group, after the base product (dense or quantized, unchanged)."""
from __future__ import annotations

import torch


class LoRARows:
    """The step's rows by adapter slot: [(slot, row indices)], set by the runner before each forward."""

    def __init__(self):
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set(self, slots: list[int], device: torch.device) -> None:
        """`slots`: each row's slot, -1 for a row without an adapter."""
        self.groups = []
        if all(s < 0 for s in slots):
            return
        t = torch.tensor(slots)
        for s in sorted(set(slots) - {-1}):
            self.groups.append((s, torch.nonzero(t == s).flatten().to(device)))


class LoRASlots(torch.nn.Module):
    """One layer's adapter slots (see the module's docs)."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, max_rank: int, rows: LoRARows,
                 dtype, device):
        super().__init__()
        parts = len(out_sizes)
        self.out_sizes, self.max_rank = list(out_sizes), max_rank
        self.a = torch.zeros(max_loras, parts * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(out_sizes), parts * max_rank, dtype=dtype, device=device)
        self.rows = rows

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s adapter into `slot`: a [rank, in], b [out_part, rank] (scaled already)."""
        rank = a.shape[0]
        assert rank <= self.max_rank and b.shape == (self.out_sizes[part], rank), (a.shape, b.shape)
        lo = sum(self.out_sizes[:part])
        self.a[slot, part * self.max_rank:part * self.max_rank + rank] = a
        self.b[slot, lo:lo + b.shape[0], part * self.max_rank:part * self.max_rank + rank] = b

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter product (x, y: [rows, in], [rows, out])."""
        for slot, idx in self.rows.groups:
            xs = x.index_select(0, idx).to(self.a.dtype)
            y.index_add_(0, idx, ((xs @ self.a[slot].T) @ self.b[slot].T).to(y.dtype))
        return y
