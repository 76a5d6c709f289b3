"""Linear layers whose output may fuse several checkpoint tensors (QKV, gate/up), dense or
kept in a quantized GGUF format, and their tensor-parallel shards.

With tensor parallelism (``pocketllm.distributed``) a layer built ``parallel="column"`` holds a
slice of each part's output rows (QKV, gate/up, the LM head), one built ``parallel="row"`` a slice
of its input columns (o_proj, down_proj) and sums the ranks' outputs (an all-reduce; its bias is
added by rank 0 alone). Slices are taken as the checkpoint tensors load: GGUF rows are independent
blocks, and GGUF columns split at block boundaries (the capabilities check, before loading, that
they do), so quantized weights stay quantized."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pocketllm.distributed.parallel_state import get_tp
from pocketllm.kernels.platform import kernels_for
from pocketllm.quant.fp8 import Fp8Linear, Fp8Weight


@dataclass
class QuantizedTensor:
    """A GGUF tensor still in its file encoding: raw bytes, type and logical (rows, cols) shape."""

    data: torch.Tensor  # uint8
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]

    def rows(self, first: int, count: int) -> QuantizedTensor:
        data = self.data.reshape(self.shape[0], -1)[first:first + count]
        return replace(self, data=data, shape=(count, *self.shape[1:]))

    def columns(self, first: int, count: int) -> QuantizedTensor:
        """Weights ``first .. first + count`` of every row: whole GGUF blocks."""
        from pocketllm.core.gguf_types import block_size, type_size

        bs, ts = block_size(self.qtype), type_size(self.qtype)
        assert first % bs == 0 and count % bs == 0, f"columns {first}+{count} split a block of {bs}"
        data = self.data.reshape(self.shape[0], -1)[:, first // bs * ts:(first + count) // bs * ts].contiguous()
        return replace(self, data=data, shape=(self.shape[0], count))


def _shard(tensor, rows: tuple[int, int] | None, cols: tuple[int, int] | None):
    """This rank's slice of a checkpoint tensor (dense or GGUF): rows and/or input columns."""
    if isinstance(tensor, QuantizedTensor):
        tensor = tensor.rows(*rows) if rows else tensor
        return tensor.columns(*cols) if cols else tensor
    if rows:
        tensor = tensor[rows[0]:rows[0] + rows[1]]
    if cols:
        tensor = tensor[:, cols[0]:cols[0] + cols[1]]
    return tensor


def _materialize(module: torch.nn.Module) -> None:
    """A weight built on the meta device takes its memory on the module's device, once."""
    w = module.weight
    if w.is_meta and w.device != module.device:  # (a module built for the meta device stays there)
        module.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=module.device),
                                           requires_grad=False)


class Linear(torch.nn.Module):
    """``parallel``: None (every rank holds it whole), "column" (each part's output rows split
    evenly over the ranks, or as ``rows`` says: per part, (first row, rows) of the checkpoint's part
    this rank holds) or "row" (the input features split evenly; ``reduce``: sum the ranks' outputs
    here, else the caller does, e.g. once after a mixture of experts). ``gather``: a column-parallel
    layer whose callers need every rank's rows (the LM head's logits)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 dtype=torch.float32, device="cpu", *, parallel: str | None = None,
                 rows: list[tuple[int, int]] | None = None, reduce: bool = True, gather: bool = False):
        super().__init__()
        tp = get_tp()
        self.tp = tp
        self.checkpoint_shape = (list(out_sizes), in_features)  # the whole layer's, before sharding
        self.rows: list[tuple[int, int]] | None = None  # per part: this rank's rows of it
        self.cols: tuple[int, int] | None = None  # this rank's input features
        self.reduce, self.gather = False, False
        if tp.size > 1 and parallel == "column":
            self.rows = rows or [tp.split(n) for n in out_sizes]
            out_sizes = [n for _, n in self.rows]
            self.gather = gather
        elif tp.size > 1 and parallel == "row":
            self.cols = tp.split(in_features)
            in_features = self.cols[1]
            self.reduce = reduce
        else:
            assert parallel in (None, "column", "row"), parallel
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.dtype, self.device = dtype, torch.device(device)  # where GGUF weights go
        out = sum(out_sizes)
        # Built on the meta device: a dense weight takes memory on `device` when its first part
        # loads, and a quantized one never does (on CUDA an empty tensor is real memory, so a
        # model's dense size would be needed for a moment otherwise).
        self.weight = torch.nn.Parameter(torch.empty(out, in_features, dtype=dtype, device="meta"),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.quantized: torch.nn.Module | None = None
        self._quant_parts: dict[int, QuantizedTensor] = {}
        self.kernels = kernels_for(device)  # GGUF weights: dequantized at load, or kept and how multiplied
        # CPU fast path: passes of 8-bit activations (see GGUFLinear); an output layer may take more
        self.int8_activations = self.kernels.int8_passes
        self.int8_rows = 0  # GPU: up to this many rows the product takes 8-bit activations (GGUFLinear)
        self.parallel = parallel
        # CUDA, dense weights: from this many rows the row-invariant GEMM (kernels/triton/invariant_gemm.py)
        self.invariant_rows: int | None = None
        self.lora = None  # LoRA adapters' slots (pocketllm.layers.lora), on layers they may target
        # block-scaled FP8 checkpoint weights kept as they are (quant/fp8.py) where the kernels multiply them;
        # a layer whose weight is read as numbers (an expert's, stacked; MLA's kv_b_proj) sets it False
        self.keeps_fp8 = self.kernels.gpu and not self.kernels.dequantize_at_load and tp.size == 1
        self._fp8_parts: dict = {}

    def load(self, tensor: torch.Tensor | QuantizedTensor, shard: int = 0, kind: str = "weight") -> None:
        lo = sum(self.out_sizes[:shard])
        hi = lo + self.out_sizes[shard]
        tensor = _shard(tensor, self.rows[shard] if self.rows else None, self.cols if kind == "weight" else None)
        if kind == "bias":
            if self.cols is None or self.tp.rank == 0:  # a row-parallel bias: added once, by rank 0
                self.bias.data[lo:hi].copy_(tensor)
        elif isinstance(tensor, QuantizedTensor):
            self._quant_parts[shard] = tensor
            if len(self._quant_parts) == len(self.out_sizes):
                self._build_quantized()
        elif isinstance(tensor, Fp8Weight) and self.keeps_fp8:  # (else dequantized below)
            assert tuple(tensor.shape) == (hi - lo, self.in_features), (tensor.shape, hi - lo, self.in_features)
            self._fp8_parts[shard] = tensor
            if len(self._fp8_parts) == len(self.out_sizes):
                self._build_fp8()
        else:
            if isinstance(tensor, Fp8Weight):
                tensor = tensor.dequantize()
            assert not self._fp8_parts, "a fused layer's parts are all FP8 or none"
            assert tuple(tensor.shape) == (hi - lo, self.in_features), (tensor.shape, hi - lo, self.in_features)
            _materialize(self)
            self.weight.data[lo:hi].copy_(tensor)

    def _build_fp8(self) -> None:
        parts = [self._fp8_parts[i] for i in range(len(self.out_sizes))]
        self._fp8_parts = {}
        bias = None if self.bias is None else self.bias.data
        if Fp8Linear.stacks(parts):
            self.quantized = Fp8Linear(parts, bias)
        else:  # (a part not a whole number of tiles tall: each its own layer)
            bounds = [sum(self.out_sizes[:i]) for i in range(len(parts) + 1)]
            self.quantized = ConcatLinear([Fp8Linear([p], None if bias is None else bias[a:b])
                                           for p, a, b in zip(parts, bounds, bounds[1:])])
        self.weight = None

    def _build_quantized(self) -> None:
        from pocketllm.quant.linear import GGUFLinear

        parts = [self._quant_parts[i] for i in range(len(self.out_sizes))]
        self._quant_parts = {}
        bias = None if self.bias is None else self.bias.data.float()
        if len({p.qtype for p in parts}) == 1:
            # Rows of a GGUF matrix are independent blocks: same-type parts fuse exactly.
            self.quantized = GGUFLinear.from_gguf([p.data.reshape(p.shape[0], -1) for p in parts],
                                                  parts[0].qtype, sum(self.out_sizes), self.in_features,
                                                  bias, device=self.device, dtype=self.dtype,
                                                  int8_activations=self.int8_activations, kernels=self.kernels)
        else:  # e.g. Q4_K_M's Q4_K q/k with a Q6_K v: one layer per part
            subs, lo = [], 0
            for p, size in zip(parts, self.out_sizes):
                b = None if bias is None else bias[lo:lo + size]
                subs.append(GGUFLinear.from_gguf(p.data, p.qtype, size, self.in_features, b, device=self.device,
                                                 dtype=self.dtype, int8_activations=self.int8_activations,
                                                 kernels=self.kernels))
                lo += size
            self.quantized = ConcatLinear(subs)
        self.int8_rows = max(p.int8_rows for p in getattr(self.quantized, "parts", [self.quantized]))
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = None if self.lora is None else self.lora.begin(x)  # (beside the product, where it can be)
        if self.quantized is not None:
            y = self.quantized(x).to(x.dtype)  # CPU paths compute in float32, CUDA ones in x's dtype
        elif self.invariant_rows is not None and x.numel() >= self.invariant_rows * self.in_features:
            from pocketllm.kernels.triton.invariant_gemm import invariant_linear

            x2 = x.reshape(-1, self.in_features).contiguous()
            y = invariant_linear(x2, self.weight, self.bias).reshape(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            y = self.lora.add(x, y, lora)
        if self.reduce:
            return self.tp.all_reduce(y)
        return self.tp.all_gather(y) if self.gather else y


def use_row_invariant_gemms(model: torch.nn.Module) -> int:
    """Speculative decoding on CUDA: the row-parallel projections (o, down) with dense weights take the
    row-invariant GEMM from ``invariant_gemm.FROM_ROWS`` rows, so that a sequence's row computes the same
    bits in a step of its drafts and other sequences' as in a plain step (cuBLAS changes its kernel there:
    invariant_gemm's docs).  The layers changed."""
    from pocketllm.kernels.triton.invariant_gemm import FROM_ROWS

    layers = [m for m in model.modules() if isinstance(m, Linear) and m.parallel == "row" and m.quantized is None]
    for m in layers:
        m.invariant_rows = FROM_ROWS
    return len(layers)


class ConcatLinear(torch.nn.Module):
    """Fused projection whose parts have different quantization types."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class Embedding(torch.nn.Module):
    """With tensor parallelism each rank holds an even share of the vocabulary's rows (a tied LM
    head too): a rank looks up the ids it holds, zeros for the others, and the ranks sum."""

    def __init__(self, num_embeddings: int, dim: int, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.tp = get_tp()
        self.vocab_start, num_embeddings = self.tp.split(num_embeddings)
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device="meta"),
                                         requires_grad=False)  # as a Linear's
        self.quantized: QuantizedTensor | None = None  # looked up row by row (on the CPU)
        self.source: QuantizedTensor | None = None  # the GGUF table, for a tied output projection
        # a GGUFLinear whose embedding_rows() serve the lookup: the tied output projection (one copy of
        # the table), or on CUDA the table's own GGUF blocks
        self.rows_from = None
        self.dtype, self.device = dtype, torch.device(device)
        self.kernels = kernels_for(device)  # on the GPU the table's own GGUF blocks serve lookups
        self.int8_activations = self.kernels.int8_passes  # for the tied output projection

    def load(self, tensor: torch.Tensor | QuantizedTensor, shard: int = 0, kind: str = "weight") -> None:
        tensor = _shard(tensor, (self.vocab_start, self.num_embeddings) if self.tp.size > 1 else None, None)
        if isinstance(tensor, QuantizedTensor) and not self.kernels.gpu:
            self.quantized = self.source = tensor
            self.weight = None
        elif isinstance(tensor, QuantizedTensor):
            # Off the CPU the table stays in its GGUF blocks where the Triton kernels cover its type
            # (each step decodes the rows it looks up), else it is dequantized once, to the model's dtype.
            from pocketllm.quant.linear import GGUFLinear

            lin = GGUFLinear.from_gguf(tensor.data, tensor.qtype, self.num_embeddings, self.dim,
                                       device=self.device, dtype=self.dtype, kernels=self.kernels)
            if lin.path == "triton":
                self.rows_from, self.weight = lin, None
            else:
                self.weight.data = lin._store  # (never materialized: this is its memory)
            self.source = tensor
        else:
            _materialize(self)
            self.weight.data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        x = self._lookup(torch.where(held, local, 0)) * held.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            return self.rows_from.embedding_rows(ids).to(self.dtype)
        if self.quantized is not None:
            from pocketllm.quant.linear import gguf_embedding_lookup

            q = self.quantized
            return gguf_embedding_lookup(q.data, q.qtype, self.num_embeddings, self.dim, ids).to(self.dtype)
        return F.embedding(ids, self.weight)

    def as_linear(self) -> Linear:
        """The same matrix as an output projection (tied embeddings), loaded as the Linear
        layers are (the engine sets this table's load settings as theirs)."""
        lin = Linear(self.dim, [self.num_embeddings], dtype=self.dtype, device="meta")
        lin.device, lin.gather = self.device, self.tp.size > 1  # this rank's rows already
        lin.kernels, lin.int8_activations = self.kernels, self.int8_activations
        if self.rows_from is not None:  # off the CPU: the table's packed GGUF blocks serve both, one copy
            lin.quantized, lin.int8_rows, lin.weight = self.rows_from, self.rows_from.int8_rows, None
            self.source = None
        elif self.quantized is not None:  # the CPU: stays quantized, maybe repacked for the fast path
            lin.load(self.source)
            q = lin.quantized
            held = q.fast_path_weights() if hasattr(q, "fast_path_weights") else None
            if held is not None and held[1]:
                # repacked for the fast path's kernels: the table is read from there, one copy
                self.quantized = self.source = None
                self.rows_from = q
        else:  # dense (or dequantized at load): the same tensor
            lin.weight, self.source = self.weight, None
        return lin
