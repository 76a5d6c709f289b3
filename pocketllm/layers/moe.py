"""A mixture-of-experts MLP: a router scores every expert for each token, the top k experts run on
it, and their outputs are summed weighted by the router's probabilities.

The experts are ordinary gated MLPs (each its own `Linear` layers), so whatever a checkpoint holds
them in (safetensors, or one of the GGUF encodings on its CPU or GPU kernels) they multiply as a
dense model's MLP does, and a step touches only the experts its tokens selected.

Two ways through the experts:
- sorted by expert (the CPU, and large steps on the GPU): the (token, slot) pairs are grouped by
  expert on the host (one sync), and each selected expert runs once on all its tokens;
- grouped (the GPU, steps of up to GROUPED_MAX_TOKENS tokens: decode): after loading, each
  projection of all experts is re-bound as one stack (`ExpertStack`, the same bytes, one copy),
  and every pair is multiplied in one launch by `kernels/triton/moe.py`, with no host sync, so
  decode steps run in CUDA graphs (the runtimes declare graphs up to that batch). From
  FUSED_MIN_TOKENS tokens, prefill included, the pairs are first sorted by expert on the device,
  and each expert's pairs are tiles of rows (its weights read once a tile of tokens) where the
  tile kernel covers the experts' encoding. On the GPU the routing (softmax, top k,
  renormalization) and the weighted sum of the experts' outputs are a kernel each
  (`kernels/triton/moe.py`), and the experts' biases are added by the activation and the sum.

Experts in host memory (`offload_experts`, cpu_offload_experts): a layer's experts are built for the
CPU and its kernels before any weight loads, so they take host memory only; the router stays on the
GPU, and each step sends the layer's input and its routing to the host, runs the selected experts
there (the sorted path, or one C call for one token) and sends the sum back: the same routing, the
experts computed in float32 by the CPU's kernels. Such a step waits for the host, so the model runs
without CUDA graphs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pocketllm.distributed.parallel_state import get_tp
from pocketllm.errors import ConfigurationError
from pocketllm.kernels.platform import building_with, kernels_for
from pocketllm.layers.linear import ConcatLinear, Linear
from pocketllm.quant.linear import GGUFLinear

GROUPED_MAX_TOKENS = 64  # up to this many tokens a step, the grouped path (and the graphs' largest batch)


@dataclass(frozen=True)
class OneCallRouting:
    """How a block routes, for the CPU's one-call decode step (kernels/cpu/llama_decode.c, route_row): the
    softmax (or sigmoid) of the router's float32 logits; choices by score plus `bias`, within the `top_groups`
    best of `groups` groups; the top k, their scores as weights, renormalized where `renormalize`, times `scaling`."""
    router: torch.Tensor  # float32 [experts, hidden]
    top_k: int
    renormalize: bool
    sigmoid: bool = False
    bias: torch.Tensor | None = None  # float32 [experts]
    groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0


class ExpertStack:
    """One projection (``gate_up_proj`` or ``down_proj``) of every expert as stacks of E matrices:
    GGUF blocks on the Triton path, or dense weights on the GPU; a projection whose parts have
    different GGUF types (a ConcatLinear) is a stack per part. Each expert's own layer keeps
    working on views of them: one copy of the weights."""

    def __init__(self, parts: list[list[torch.nn.Module]]):
        self.parts = [_PartStack(p) for p in parts]
        biases = [p.bias for p in self.parts]  # a layer's parts (one Linear's) all have biases, or none
        assert len({b is None for b in biases}) == 1
        # [E, N]: each expert's bias over all the parts' features (for kernels that add it), or None
        self.bias = biases[0] if len(biases) == 1 or biases[0] is None else torch.cat(biases, dim=1)

    @staticmethod
    def of(layers: list[Linear]) -> ExpertStack | None:
        """The stack of these experts' layers (the GPU's grouped kernels), or None where those do not
        cover them (experts of different encodings)."""
        per_expert = [_parts(layer) for layer in layers]
        parts = [list(p) for p in zip(*per_expert)]
        if any(len(p) != len(parts) for p in per_expert) or not all(_PartStack.covers(p) for p in parts):
            return None
        return ExpertStack(parts)

    @property
    def fused(self) -> bool:
        """Whether the expert-sorted tile kernel covers every part."""
        return all(p.fused for p in self.parts)

    @property
    def int8(self) -> bool:
        """Whether a part's grouped GEMV runs on 8-bit activations (16-bit ones, which ``int8_act``
        checks)."""
        from pocketllm.kernels.triton.gguf_q8 import Q8_TYPES

        return any(p.qtype in Q8_TYPES for p in self.parts)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, x_div: int, routing=None,
                 add_bias: bool = True) -> torch.Tensor:
        """[P, N]: row p = x[p // x_div] @ W[ids[p]].T (+ its bias, unless ``add_bias`` is False: the
        caller adds ``self.bias``);
        ``routing``: the pairs sorted by expert (`kernels.triton.moe.align`) for the tile kernel,
        else one launch over the pairs."""
        ys = [part(x, ids, x_div, routing, add_bias) for part in self.parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def _parts(layer: Linear) -> list[torch.nn.Module]:
    """What computes a layer: its GGUF layer(s), or the dense `Linear` itself."""
    q = layer.quantized
    if q is None:
        return [layer]
    return list(q.parts) if isinstance(q, ConcatLinear) else [q]


class _PartStack:
    """The same part of every expert's projection (a GGUFLinear each, or a dense `Linear` each)."""

    def __init__(self, modules: list[torch.nn.Module]):
        first = modules[0]
        dense = isinstance(first, Linear)
        self.n = sum(first.out_sizes) if dense else first.out_features
        self.k = first.in_features
        self.qtype = None if dense or first.path != "triton" else first.qtype
        if self.qtype is None:
            self.fused = True
        else:  # the Triton GGUF path: triton is there
            from pocketllm.kernels.triton.gguf_mma import MMA_TYPES
            self.fused = self.qtype in MMA_TYPES
        self.modules, self.dense = modules, dense
        biases = [m.bias for m in modules]
        self.bias = None if biases[0] is None else torch.stack([b.data for b in biases])  # [E, N]
        self.stacked = torch.cat([m.weight.data if dense else m._store for m in modules])
        self.rehome(self.stacked)

    def rehome(self, stacked: torch.Tensor) -> None:
        """The experts' own layers hold views of `stacked` (their weights, in this stack's layout): one copy."""
        for i, m in enumerate(self.modules):
            view, bias = stacked[i * self.n:(i + 1) * self.n], None if self.bias is None else self.bias[i]
            if self.dense:  # a Linear's Parameters
                m.weight.data = view
                if bias is not None:
                    m.bias.data = bias
            else:
                m._store, m.bias = view, bias

    @staticmethod
    def covers(modules: list[torch.nn.Module]) -> bool:
        if all(isinstance(m, Linear) for m in modules):
            return True
        if not all(isinstance(m, GGUFLinear) for m in modules):
            return False
        if all(m.path == "triton" for m in modules):
            return len({m.qtype for m in modules}) == 1
        return all(m.path == "dense" for m in modules)  # dequantized at load

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, x_div: int, routing=None,
                 add_bias: bool = True) -> torch.Tensor:
        if routing is not None:
            from pocketllm.kernels.triton.moe import fused_moe
            y = fused_moe(x if self.qtype is not None else x.to(self.stacked.dtype), self.stacked, self.qtype,
                          self.k, self.n, routing, x_div)
        elif self.qtype is not None:
            from pocketllm.kernels.triton.gguf import gguf_grouped_gemv
            from pocketllm.kernels.triton.int8_act import attached

            y = gguf_grouped_gemv(x, self.stacked, self.qtype, self.k, self.n, ids, x_div, attached(x))
        else:
            from pocketllm.kernels.triton.moe import grouped_dense_gemv

            y = grouped_dense_gemv(x.to(self.stacked.dtype), self.stacked, self.n, ids, x_div)
        if self.bias is not None and add_bias:
            y = y + self.bias[ids.reshape(-1)]
        return y


def _dense_weights(moe: torch.nn.Module) -> None:
    """The router and the experts read their weights as numbers (stacked, or by the routing GEMV): an FP8
    checkpoint's are dequantized at load."""
    for m in moe.modules():
        if isinstance(m, Linear):
            m.keeps_fp8 = False


def _router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] . weight [E, hidden]^T on CUDA: the CUDA C GEMV in bf16 / fp16 (a row's bits at any row
    count), else ``F.linear`` (float32, or where NVRTC cannot build the kernel)."""
    from pocketllm.kernels.cuda import dense_gemv

    x2 = x.reshape(-1, x.shape[-1])
    y = dense_gemv.linear(x2, weight) if dense_gemv.usable(x2, weight) else None
    return F.linear(x, weight) if y is None else y


class SparseMoE(torch.nn.Module):
    """``gate``: the router, a [num_experts, hidden] projection. Routing as transformers computes
    it: Qwen3-MoE and Mixtral take a softmax over all experts in float32, then the top k
    (torch.topk's order and ties), renormalised to sum to 1 when ``renormalize``; gpt-oss
    (``softmax_of_top_k``, a router bias) takes the top k logits, then a softmax over those."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert: Callable[[torch.device | str, torch.dtype], torch.nn.Module], dtype, device,
                 router_bias: bool = False, softmax_of_top_k: bool = False):
        super().__init__()
        assert 0 < top_k <= num_experts, (top_k, num_experts)
        self.top_k, self.renormalize, self.softmax_of_top_k = top_k, renormalize, softmax_of_top_k
        self.tp = get_tp()
        self.gate = Linear(hidden_size, [num_experts], router_bias, dtype=dtype, device=device)
        self.make_expert = make_expert  # (device, dtype) -> an expert
        self.experts = torch.nn.ModuleList(make_expert(device, dtype) for _ in range(num_experts))
        _dense_weights(self)
        self.shared_experts: torch.nn.Module | None = None  # (DeepSeek's: an MLP every token takes, added to the sum)
        self.on_host = False  # the experts live in host memory and run on the CPU's kernels (offload_experts)
        self.cache_slots = 0  # or: they live in host memory and are copied to this many slots (ExpertCache)
        self.cache = None
        self.stacks: tuple[ExpertStack, ExpertStack] | None = None  # (gate_up, down), after loading
        self.fused_kind: str | None = None  # "gguf" / "dense" where the tile kernel covers both stacks
        self.kernels = kernels_for(device)  # the CPU fast path: a token's experts in one C call (DecodeExperts)
        self._cpu_experts = None  # built at the first such step; False where the experts are not covered
        # GPU: up to how many tokens (pairs) a step the grouped GEMVs take the layer's input (the
        # activation's output) in 8 bits, so that its producer writes them (int8_act)
        self.int8_tokens = self.int8_pairs = 0

    def place_experts_on_host(self, kernels, cache_slots: int = 0, dtype: torch.dtype = torch.float32) -> None:
        """Before loading: the experts rebuilt in host memory, the router staying where the layer is.
        Either run there by the CPU's `kernels`, in float32 (what they compute in), or (`cache_slots`)
        in the layer's own encoding and `dtype`, copied to that many slots on its device as steps
        select them (ExpertCache)."""
        assert not cache_slots or kernels is self.kernels
        with building_with(kernels):
            self.experts = torch.nn.ModuleList(self.make_expert("cpu", dtype) for _ in self.experts)
        _dense_weights(self)
        self.on_host, self.cache_slots = not cache_slots, cache_slots

    def finish_loading(self) -> None:
        """Stack the experts' projections where the grouped kernels take them."""
        if not self.kernels.gpu or self.on_host:
            return
        gate_up = ExpertStack.of([e.gate_up_proj for e in self.experts])
        down = ExpertStack.of([e.down_proj for e in self.experts]) if gate_up is not None else None
        self.stacks = (gate_up, down) if down is not None else None
        if self.stacks is not None and gate_up.fused and down.fused:
            dense = all(part.qtype is None for stack in self.stacks for part in stack.parts)
            self.fused_kind = "dense" if dense else "gguf"
        if self.cache_slots:
            from pocketllm.layers.expert_cache import ExpertCache

            if self.stacks is None:
                raise ConfigurationError("expert_offload copy: these experts' encodings have no grouped GPU kernels "
                                         "(experts of different types in one layer); use expert_offload compute")
            self.cache = ExpertCache(self.stacks, len(self.experts), self.cache_slots, self.gate.device)
        if self.stacks is not None:
            from pocketllm.kernels.triton.moe import FUSED_MIN_TOKENS

            grouped = GROUPED_MAX_TOKENS if self.fused_kind is None else FUSED_MIN_TOKENS[self.fused_kind] - 1
            self.int8_tokens = grouped if gate_up.int8 else 0
            self.int8_pairs = grouped * self.top_k if down.int8 else 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int64 [T, k]) for the tokens x [T, hidden]."""
        if self.kernels.gpu:  # softmax, top k and renormalization in one launch
            from pocketllm.kernels.triton.moe import top_k_route

            gate = self.gate
            if gate.quantized is not None:
                return top_k_route(gate(x), self.top_k, self.renormalize, self.softmax_of_top_k)
            # A token's experts must not depend on its step's rows (drafts verified in a step of several rows
            # see the experts plain decoding sees; a prompt's tail after a prefix-cache hit those its first
            # prefill saw): cuBLAS picks other kernels by row count, and adds a bias with another at one row
            # than at several (gpt-oss). So the logits come from the CUDA C GEMV, whose rows keep their bits
            # at any row count (and at one row takes 2.0 us where cuBLAS takes 5.3, Qwen3-30B-A3B's router,
            # results/h200-dense-gemv.txt), and the routing kernel adds the bias.
            return top_k_route(_router_logits(x, gate.weight), self.top_k, self.renormalize, self.softmax_of_top_k,
                               gate.bias)
        if self.softmax_of_top_k:
            logits, ids = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), ids
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def one_call_routing(self) -> OneCallRouting | None:
        """How this block routes, where the CPU's one-call decode step (kernels/cpu/llama_decode.c) can route
        as it does: a softmax over every expert's logit, then the top k. None for gpt-oss's softmax of the top
        k, a router bias, a quantized router, another route() (DeepSeek's, which says its own) or experts moved
        to host memory or split over ranks."""
        if type(self).route is not SparseMoE.route or self.softmax_of_top_k or not self._one_call_router():
            return None
        return OneCallRouting(self.gate.weight.data.contiguous(), self.top_k, self.renormalize)

    def _one_call_router(self) -> bool:
        """Whether the router and the experts are where the one call reads them: a float32 router without a
        bias, every expert on this host."""
        gate = self.gate
        return not (gate.bias is not None or gate.quantized is not None or gate.weight.dtype != torch.float32
                    or self.on_host or self.cache is not None or self.tp.size > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With tensor parallelism each expert holds a share of its intermediate features (its
        # down projection's bias on rank 0 alone, `make_expert` builds it without a sum): the
        # ranks' weighted sums add up to the layer's output, one all-reduce.
        return self.tp.all_reduce(self._experts(x))

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, plus the shared experts' output where there are some."""
        weights, ids = self.route(x)
        if not self.on_host and (one_call := self._decode_call(x)):
            y = one_call(x.contiguous(), ids, weights)
            return y if one_call.with_shared or self.shared_experts is None else y + self.shared_experts(x)
        if self.on_host:  # (waits for the device: the routing is read on the host)
            y = self._host_experts(x.to("cpu", torch.float32), weights.cpu(), ids.cpu())
            y = y.to(x.device, x.dtype, non_blocking=True)
        elif self.cache is not None:
            y = self.cache.run(x, weights, ids, self._stacked)
        elif (y := self._stacked(x, weights, ids, ids, len(self.experts))) is None:
            assert not (self.kernels.gpu and torch.cuda.is_current_stream_capturing()), \
                "a CUDA graph was captured over more tokens than the grouped expert path takes"
            y = self._host_experts(x, weights, ids) if not self.kernels.gpu else self._sorted_experts(x, weights, ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def _decode_call(self, x: torch.Tensor):
        """The CPU fast path's one C call for one token's experts (DecodeExperts; the shared experts in it too
        where the call covers them, not where the routed ones moved to host memory), or None."""
        if x.shape[0] != 1 or not self.experts[0].kernels.cpu_fused or x.dtype != torch.float32:
            return None
        if self._cpu_experts is None:
            from pocketllm.kernels.cpu.llama_decode import DecodeExperts

            shared = None if self.on_host else self.shared_experts
            self._cpu_experts = (shared is not None and DecodeExperts.build(self.experts, shared)
                                 or DecodeExperts.build(self.experts) or False)
        return self._cpu_experts or None

    def _stacked(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, stack_ids: torch.Tensor,
                 stacked: int, grouped_max: int = GROUPED_MAX_TOKENS) -> torch.Tensor | None:
        """The experts through the stacks (`stack_ids`: each pair's entry in them, of `stacked`; `ids`: its
        expert, whose bias it takes), or None where the step is too large for them (up to `grouped_max`
        tokens a step without the tile kernel)."""
        t, k = ids.shape
        routing = None
        if self.fused_kind is not None:
            from pocketllm.kernels.triton import moe as kmoe

            most = kmoe.FUSED_MAX_PAIRS_PER_EXPERT * stacked // k  # tokens: past it, dequantize + cuBLAS
            if kmoe.FUSED_MIN_TOKENS[self.fused_kind] <= t <= most:
                routing = kmoe.align(stack_ids, stacked)
        if routing is None and (self.stacks is None or t > grouped_max):
            return None
        from pocketllm.kernels.triton.moe import weighted_sum

        # the experts' biases added by the weighted sum and (its kernel, on CUDA) the activation,
        # not launches of their own
        gate_up, down = self.stacks
        pair_ids, fold = ids.reshape(-1), self.kernels.gpu
        h = self.experts[0].activation(gate_up(x, stack_ids, k, routing, add_bias=not fold),
                                       gate_up.bias if fold else None, pair_ids, self.int8_pairs)
        return weighted_sum(down(h, stack_ids, 1, routing, add_bias=False), weights, down.bias, pair_ids).to(x.dtype)

    def _host_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CPU's experts: one token's in one C call on the fast path, else sorted by expert."""
        if one_call := self._decode_call(x):
            return one_call(x.contiguous(), ids, weights)
        return self._sorted_experts(x, weights, ids)

    def _sorted_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(token, slot) pairs grouped by expert: each selected expert runs once on its tokens."""
        flat = ids.flatten()
        if x.shape[0] == 1:  # decode of one sequence: its k experts in turn, no grouping work
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e, w in zip(flat.tolist(), weights[0]):
                out += self.experts[e](x).float() * w
            return out.to(x.dtype)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens, w = order // self.top_k, weights.flatten()[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, expert(x[rows]).float() * w[start:start + n, None])
                start += n
        return out.to(x.dtype)


def offload_experts(model: torch.nn.Module, setting: str, kernels, cache_slots: int | None = None,
                    dtype: torch.dtype = torch.float32) -> list[SparseMoE]:
    """Before loading: the experts of the first N mixture-of-experts layers (`setting`: N, or "all") in
    host memory, on the CPU's `kernels` (llama.cpp's --n-cpu-moe keeps the first N layers' experts on
    the CPU), or (`cache_slots` not None) copied to that many slots a layer on the device (0: four times
    the experts a token takes), in the layer's own kernels and `dtype`. The layers whose experts moved."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    layers = len(blocks) if setting == "all" else int(setting)
    if layers > len(blocks):
        raise ConfigurationError(f"cpu_offload_experts {layers}: the model has {len(blocks)} layers of experts; "
                                 f"give at most {len(blocks)}, or all")
    for moe in blocks[:layers]:
        if cache_slots is None:
            moe.place_experts_on_host(kernels)
        else:
            moe.place_experts_on_host(moe.kernels, min(cache_slots or 4 * moe.top_k, len(moe.experts)), dtype)
    return blocks[:layers]
