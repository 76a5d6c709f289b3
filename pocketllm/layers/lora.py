"""LoRA adapters on the model's Linear layers: many adapters in one step, each row its own.

A targeted layer holds `max_loras` slots of adapter weights: A [slots * parts * r, in] and B, kept
transposed, [slots * parts * r, out], r the largest rank allowed. A fused layer (QKV, gate/up) takes one adapter
per part: part i's A rows in a slot are i * r .. i * r + rank_i, its B block is those columns of its
own output rows, zeros elsewhere, so one pair of products gives every part its own adapter (the zeros
add exactly nothing). The scaling (alpha / rank, or alpha / sqrt(rank) for rsLoRA) is folded into B.

A step's rows each run the adapter of their request's slot (or none); a step without adapter rows
does none of what follows. Two ways, by the layer's kernels (chosen once, `LoRARows.grouped`):
- grouped (the GPU's): the rows sorted by slot, each slot's rows multiplied by its own A and B only
  (kernels/triton/lora.py, Punica's SGMV), two launches a layer, the first beside the layer's own
  product; CUDA graphs capture them once.
- masked (the CPU's torch layers): every row times every slot's A at once (one product: slots * parts
  * r columns, small beside the layer's own), each row keeping its own slot's columns
  (`LoRARows.mask`), times B. The CPU's one-call decoder reads the rows' slots itself.
Either adds to the base output (dense or quantized, unchanged)."""
from __future__ import annotations

import contextlib

import torch


class LoRARows:
    """Each row's slot for the step, set by the runner before each forward: `slots` (int64 on the host,
    -1 for none: the CPU's one-call decoder reads them), and per the module's two ways either `perm` and
    `chunks` on the device (the rows sorted by slot, and (slot, first, end) a 16 of them: kernels/triton/lora.py)
    or `mask` ([rows, slots, 1] ones and zeros). `active`: some row has an adapter."""

    def __init__(self, max_loras: int, device: torch.device, *, grouped: bool, capacity: int = 0):
        """`capacity`: the most rows of a step (grouped: its buffers are fixed, for CUDA graphs)."""
        self.max_loras, self.device, self.grouped = max_loras, device, grouped
        self.active = False
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._cast: dict[torch.dtype, torch.Tensor] = {}
        if grouped:
            from pocketllm.kernels.triton.lora import max_chunks

            self._perm = torch.zeros(max(capacity, 1), dtype=torch.int32, device=device)
            self._chunks = torch.zeros(max_chunks(max(capacity, 1), max_loras), 3, dtype=torch.int32, device=device)
            self.perm, self.chunks = self._perm, self._chunks
            self.grid = 0  # the chunks the kernels cover (kernels/triton/lora.py)

    def set(self, slots: list[int]) -> None:
        """`slots`: each row's slot, -1 for a row without an adapter."""
        self._cast = {}
        self.active = any(s >= 0 for s in slots)
        self.slots = torch.tensor(slots, dtype=torch.int64) if self.active else None
        self.mask = None
        if not self.active:
            return
        if not self.grouped:
            self.mask = (self.slots[:, None] == torch.arange(self.max_loras)[None, :]).float()[:, :, None].to(
                self.device)
            return
        from pocketllm.kernels.triton.lora import chunks_of, upload

        perm = sorted((i for i, s in enumerate(slots) if s >= 0), key=slots.__getitem__)
        chunks = chunks_of(torch.bincount(self.slots[self.slots >= 0], minlength=self.max_loras).tolist())
        self.grid = len(chunks)
        self.perm, self.chunks = self._perm, self._chunks
        if len(perm) > self._perm.numel():  # a step of more rows than the buffers (never a graph's): its own
            self.perm = torch.empty(len(perm), dtype=torch.int32, device=self.device)
            self.chunks = torch.empty(len(chunks), 3, dtype=torch.int32, device=self.device)
        # (the chunks past the step's are (0, 0, 0): a graph's grid covers as many as its rows can make)
        pad = [0] * (self.chunks.numel() - 3 * len(chunks))
        upload(perm + [v for c in chunks for v in c] + pad, self.perm[:len(perm)], self.chunks)

    @contextlib.contextmanager
    def capturing(self, rows: int):
        """Within: a CUDA graph of `rows` rows is captured with the adapters' kernels, for any mix of
        slots (no row has one while it warms up and captures)."""
        from pocketllm.kernels.triton.lora import max_chunks

        assert self.grouped and rows <= self._perm.numel(), rows
        self._chunks.zero_()
        self.active, self.perm, self.chunks = True, self._perm, self._chunks
        self.grid = max_chunks(rows, self.max_loras)
        try:
            yield
        finally:
            self.active = False

    @contextlib.contextmanager
    def after(self, n: int):
        """Within: the rows from `n` on (a step's prompt chunks, run apart from its decode rows)."""
        slots = None if self.slots is None else self.slots.tolist()
        if slots is not None:
            self.set(slots[n:])
        try:
            yield
        finally:
            if slots is not None:
                self.set(slots)

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

    def begin(self, x: torch.Tensor):
        """Before the layer's own product: the grouped way starts the shrink beside it (None: nothing begun)."""
        rows = self.rows
        if not (rows.active and rows.grouped):
            return None
        from pocketllm.kernels.triton.lora import shrink

        return shrink(x, self.a, rows.perm, rows.chunks, rows.grid, self.width)

    def add(self, x: torch.Tensor, y: torch.Tensor, begun=None) -> torch.Tensor:
        """y plus each row's adapter product (x, y: [rows, in], [rows, out]; grouped: y in place, `begun`
        what `begin` returned)."""
        rows = self.rows
        if not rows.active:
            return y
        if rows.grouped:
            from pocketllm.kernels.triton.lora import expand

            expand(begun, self.bt, y, rows.perm, rows.chunks, rows.grid, self.width)
            return y
        xa = (x.to(self.a.dtype) @ self.a.T).view(x.shape[0], -1, self.width) * self.rows.mask_as(self.a.dtype)
        return y + (xa.view(x.shape[0], -1) @ self.bt).to(y.dtype)
