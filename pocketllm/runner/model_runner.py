"""Turns a SchedulerOutput into one flattened varlen forward and samples the rows that end.

The KV cache is allocated here once, a K and a V tensor per place of the KV layout's groups
(pocketllm.core.kv_layout; one per layer without sliding-window layers), and bound to the model's
attention layers. Each KV group gets its own slots and block tables in the step's metadata.
On the CPU attention runs in torch over per-request masks (a sliding group's tables start at its
window); on CUDA it runs in the Triton kernels over flat metadata tensors, and pure-decode steps
replay captured CUDA graphs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pocketllm.core.kv_dtype import kv_quant, value_bytes
from pocketllm.core.kv_layout import NO_BLOCK, KVLayout, KVShape
from pocketllm.core.scheduler_output import SchedulerOutput
from pocketllm.core.step import StepInputs
from pocketllm.distributed.parallel_state import TPGroup, get_tp
from pocketllm.layers.attention import AttentionMetadata, PrefillSpan
from pocketllm.models.base import CausalLM
from pocketllm.runner.draft_position import DraftPosition
from pocketllm.runner.pooler import pool
from pocketllm.runner.sampler import DeviceSample, SampledToken, Sampler, token_logprobs


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted drafts and the token after them
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id -> (its first scored prompt position, one SampledToken per position from there)
    prompt_logprobs: dict[str, tuple[int, list[SampledToken]]] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> why it could not be sampled
    pooled: dict[str, list[float]] = field(default_factory=dict)  # request id -> its embedding (task embed)
    hidden: torch.Tensor | None = None  # the final hidden state of every row of the step (`keep_hidden`)
    forward_time: float = 0.0  # seconds spent in the model and sampler (launch and wait)
    device_time: float | None = None  # the step's time on the GPU's clock, when the runner times steps
    prepare_time: float = 0.0  # seconds spent building inputs


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `collect` reads it back."""

    sample: DeviceSample | None
    tokens: torch.Tensor | None  # the sampled ids on the device
    sampling: list  # requests (and DraftPositions), in sample row order
    prepare_time: float
    launch_time: float
    prompt_scores: list[tuple] = field(default_factory=list)  # StepInputs.prompt_scores
    prompt_sample: DeviceSample | None = None  # their logprobs, a row per scored position
    events: tuple | None = None  # CUDA events around the step's work, when the runner times steps
    pooled: list[tuple] = field(default_factory=list)  # (request id, its embedding on its way to the host)
    hidden: torch.Tensor | None = None  # every row's final hidden state, on the device (`keep_hidden`)

    def sample_row(self) -> dict[str, int]:
        """Where each request's (one) sampled token is: a step with drafts is never overlapped."""
        return {req.request_id: i for i, req in enumerate(self.sampling)}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, reserve: bool) -> torch.Tensor:
    """Zero-filled KV memory. On the CPU, unless `reserve`, it comes from calloc (numpy), whose large
    blocks are lazily zeroed pages: the cache becomes resident only as requests fill it. (Zeros, not
    garbage: masked slots are still read, and NaN * 0 would poison the attention.)"""
    if device.type != "cpu" or reserve or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * elem, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, seed: int = 0, max_decode_rows: int = 64, max_model_len: int = 2048,
                 enforce_eager: bool = False, kv_layout: KVLayout | None = None, reserve_kv: bool = False,
                 kv_cache_dtype: str = "auto", lora=None):
        self.model = model
        self.block_size = block_size
        self.device = device
        cfg = model.cfg
        self.tp = get_tp()
        layout = kv_layout or KVLayout.of([None] * cfg.num_layers)
        self.windows = layout.windows  # per KV group
        # this rank's heads; none for an encoder, which keeps no KV (its blocks only count its tokens)
        kv = type(model).kv_shape(cfg)
        heads = 0 if model.capabilities.encoder else self.tp.kv_heads(kv.heads)[1]
        shape = (num_blocks, block_size, heads, kv.head_dim)
        # KV tensor t holds place t of every group: layers of different groups share it, each
        # through its own group's block ids.
        quant = kv_quant(kv_cache_dtype)
        held = kv_dtype if quant is None else quant.storage
        self.k_caches = [_zeros(shape, held, device, reserve_kv) for _ in range(layout.layers_per_block)]
        self.v_caches = self.k_caches if kv.shared else [_zeros(shape, held, device, reserve_kv)
                                                         for _ in range(layout.layers_per_block)]
        # 8-bit caches: (K, V) scales a token and head, beside the values, indexed by the same block ids
        self.kv_scales = None if quant is None else [
            tuple(_zeros(shape[:3], torch.float32, device, reserve_kv) for _ in range(2))
            for _ in range(layout.layers_per_block)]
        place = layout.placement()  # (a drafting layer's layout has its one layer, whatever its config says)
        for attn, (g, _) in zip(model.attention_layers(), place):
            w = attn.window
            assert self.windows[g] in (None, w), f"a layer of window {w} in a KV group of window {self.windows[g]}"
        model.bind_kv_cache([self.k_caches[t] for _, t in place], [self.v_caches[t] for _, t in place],
                            [g for g, _ in place], None if quant is None else [self.kv_scales[t] for _, t in place])
        self.sampler = Sampler(seed, device)
        # each step's final hidden states (every row, in the step's row order) kept for a drafter that reads them
        self.keep_hidden = False
        # LoRA adapters (runner.lora_manager.LoRAManager): each step's rows get their request's slot
        self.lora = lora
        self.use_kernels = device.type == "cuda"
        # CUDA: time each step on the GPU's clock (benchmarks; the host's clock times the launch
        # under asynchronous scheduling). Reading a step's time waits for it, chunks without samples too.
        self.time_steps = False
        self.graphs = None
        self.broadcast = None  # tensor parallelism: rank 0 sends each step to the other ranks, they receive it
        # a step was sent to the other ranks and has not run all its collectives: if it raised, the
        # ranks are out of step for good (the engine cannot go on)
        self.ranks_mid_step = False
        if self.tp.size > 1:
            from pocketllm.distributed.step_broadcast import StepBroadcast

            self.broadcast = StepBroadcast(device)
        # (graphs with the collectives inside are not measured yet: tensor-parallel steps run eagerly)
        if self.use_kernels and model.capabilities.cuda_graphs and not enforce_eager and self.tp.size == 1:
            from pocketllm.runner.cuda_graphs import DecodeGraphs

            largest = min(max_decode_rows, model.capabilities.cuda_graph_max_batch or max_decode_rows)
            self.graphs = DecodeGraphs(model, device, largest, -(-max_model_len // block_size), self.windows,
                                       None if lora is None else lora.rows)

    @staticmethod
    def kv_bytes_per_block(kv: KVShape, layout: KVLayout, block_size: int, kv_dtype: torch.dtype, tp_size: int = 1,
                           kv_cache_dtype: str = "auto") -> int:
        """K and V (or the one shared tensor) of one block id on one rank: `layout.layers_per_block` layers'
        worth of its KV heads (values, and an 8-bit cache's scales)."""
        heads = TPGroup(0, tp_size).kv_heads(kv.heads)[1]
        values = kv.tensors * layout.layers_per_block * block_size * heads
        return round(values * kv.head_dim * value_bytes(kv_cache_dtype, kv_dtype, kv.head_dim))

    def flatten(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[tuple[int, int]] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampling = []
        pending: list[tuple[int, int]] = []
        prompt_scores: list[tuple] = []
        pooling: list[tuple] = []
        row_requests = []
        prev_rows = None
        # Decode rows come first; they are most of a busy step, so they get a lean loop. A request
        # with drafts makes a decode row of its last token and of each draft, each attending up to
        # itself: every row's KV is written before any row attends, so this is causal attention
        # over the drafts, on the decode kernels (and graphs).
        # (Here the first KV group; other groups' slots and tables follow in _other_groups.)
        # A few known tokens of one sequence (a draft model catching up) make decode rows the same way.
        for sr in out.scheduled[:out.num_decodes]:
            req = sr.request
            p, blocks, tokens, drafts = sr.start, req.block_tables[0], req.all_token_ids, sr.spec_token_ids
            if p < len(tokens):
                input_ids += tokens[p:p + sr.num_tokens - len(drafts)]
            else:  # the token the previous step is sampling
                if prev_rows is None:
                    prev_rows = prev.sample_row()
                pending.append((len(input_ids), prev_rows[req.request_id]))
                input_ids.append(0)
            if drafts:
                input_ids += drafts
                sampling.append(req)
                sampling += [DraftPosition(req, drafts, i) for i in range(1, len(drafts) + 1)]
            elif req.pooling is not None:  # a one-token prompt to embed
                pooling.append((req, len(positions), 1, p, sr.samples))
            elif sr.samples:
                sampling.append(req)
            for q in range(p, p + sr.num_tokens):
                positions.append(q)
                slots.append(blocks[q // bs] * bs + q % bs)
                rows.append((1, q + 1))
                n_blocks = q // bs + 1  # a rolled-back request may hold blocks past its context
                tables.append(blocks if len(blocks) == n_blocks else blocks[:n_blocks])
                row_requests.append(req)
            if drafts:
                logits_rows += range(len(positions) - sr.num_tokens, len(positions))
            elif sr.samples and req.pooling is None:
                logits_rows.append(len(positions) - 1)
        num_decode_rows = len(rows)
        for sr in out.scheduled[out.num_decodes:]:
            req, n, start = sr.request, sr.num_tokens, sr.start
            blocks = req.block_tables[0]
            input_ids += req.all_token_ids[start:start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [blocks[p // bs] * bs + p % bs for p in pos]
            ctx = start + n
            rows.append((n, ctx))
            tables.append(blocks[:-(-ctx // bs)])
            row_requests.append(req)
            if req.pooling is not None:
                pooling.append((req, len(input_ids) - n, n, start, sr.samples))
            elif sr.samples:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)
            if req.params.prompt_logprobs is not None:
                # position p scores prompt token p + 1; positions scored before (a recomputation) are not again
                first, last = max(start, req.num_prompt_scored), min(ctx, req.num_prompt_tokens - 1)
                if first < last:
                    prompt_scores.append((req, first, len(input_ids) - ctx + first,
                                          req.prompt_token_ids[first + 1:last + 1]))
        step = StepInputs(input_ids, positions, [slots], rows, [tables], num_decode_rows, logits_rows, sampling,
                          pending, prompt_scores, pooling=pooling)
        if num_decode_rows > out.num_decodes:  # a request with drafts: each decode row's index in its request
            step.chain_pos = [i for sr in out.scheduled[:out.num_decodes] for i in range(sr.num_tokens)]
        if len(self.windows) > 1:
            self._other_groups(row_requests, step)
        return step

    def _other_groups(self, row_requests: list, step: StepInputs) -> None:
        """The slots and block tables of KV groups 1.. (a model with sliding-window layers)."""
        bs = self.block_size
        for g in range(1, len(self.windows)):
            slots: list[int] = []
            tables: list[list[int]] = []
            for req, (n, ctx) in zip(row_requests, step.rows):
                blocks = req.block_tables[g]
                slots += [blocks[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
                tables.append(blocks[:-(-ctx // bs)])
            step.slots.append(slots)
            step.tables.append(tables)

    def _torch_metadata(self, step: StepInputs) -> AttentionMetadata:
        masks: dict = {}  # groups of one window share their masks and context lengths
        metas = [self._torch_group(step, g, w, masks) for g, w in enumerate(self.windows)]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    def _torch_group(self, step: StepInputs, g: int, window: int | None, masks: dict) -> AttentionMetadata:
        """One KV group's metadata. A sliding group's tables start, per row, at the block of the
        first position its queries see, and its masks and context lengths count from there: the
        blocks behind the window (released: NO_BLOCK) are never read. `masks` holds the masks of
        the step's groups built so far, by window: every group's rows have the same positions."""
        dev, bs, n = self.device, self.block_size, step.num_decodes
        meta = AttentionMetadata(slot_mapping=torch.tensor(step.slots[g], dtype=torch.long, device=dev),
                                 num_decodes=n, window=window)
        tables = step.tables[g]
        firsts = [0] * n if window is None else [max(0, ctx - window) // bs for _, ctx in step.rows[:n]]
        if n:
            cut = tables[:n] if window is None else [t[first:] for t, first in zip(tables[:n], firsts)]
            assert window is None or all(t[0] != NO_BLOCK for t in cut), "a released block inside a decode row's window"
            width = max(len(t) for t in cut)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in cut],
                                                    dtype=torch.long, device=dev)
        if window not in masks:
            decode = None
            if n:
                # context lengths from each row's first block: a window is their last `window` keys
                lens = torch.tensor([ctx - first * bs for (_, ctx), first in zip(step.rows[:n], firsts)], device=dev)
                idx = torch.arange(width * bs, device=dev)[None, :]
                mask = idx < lens[:, None]
                if window is not None:
                    mask &= idx >= lens[:, None] - window
                decode = (lens, mask[:, None, None, :])
            spans = []
            for ql, ctx in step.rows[n:]:
                q_pos = torch.arange(ctx - ql, ctx, device=dev)[:, None]
                key0 = 0 if window is None else max(0, ctx - ql - window + 1) // bs * bs
                k_pos = torch.arange(key0, ctx, device=dev)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                spans.append((key0, mask))
            masks[window] = (decode, spans)
        decode, spans = masks[window]
        if decode is not None:
            meta.decode_lens, meta.decode_mask = decode
        q0 = n
        for (ql, ctx), blocks, (key0, mask) in zip(step.rows[n:], tables[n:], spans):
            blocks = blocks[key0 // bs:]
            assert blocks[0] != NO_BLOCK, "a released block inside a prefill chunk's window"
            meta.prefills.append(PrefillSpan(q0, ql, ctx - key0, torch.tensor(blocks, dtype=torch.long, device=dev),
                                             mask))
            q0 += ql
        return meta

    def _kernel_metadata(self, step: StepInputs) -> AttentionMetadata:
        """Flat tensors for the Triton kernels, every KV group's tables at their full width (entries
        behind a sliding group's window stay NO_BLOCK: the kernel starts its keys at the window)."""
        qlens = np.array([ql for ql, _ in step.rows], dtype=np.int32)
        host = {
            "seq_lens": torch.tensor([ctx for _, ctx in step.rows], dtype=torch.int32),
            "query_start_loc": torch.from_numpy(np.concatenate(([0], np.cumsum(qlens))).astype(np.int32)),
        }
        if step.chain_pos and step.num_decodes == len(step.rows):  # (the kernel runs decode-only steps in chains)
            host["chain_pos"] = torch.tensor(step.chain_pos, dtype=torch.int32)
        for g, group_tables in enumerate(step.tables):
            width = max(len(b) for b in group_tables)
            tables = np.zeros((len(step.rows), width), dtype=np.int32)
            for i, blocks in enumerate(group_tables):
                tables[i, :len(blocks)] = blocks
            host[f"slot_mapping{g}"] = torch.tensor(step.slots[g], dtype=torch.long)
            host[f"block_tables{g}"] = torch.from_numpy(tables)
        if self.device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        dev = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        metas = [AttentionMetadata(slot_mapping=dev[f"slot_mapping{g}"], num_decodes=step.num_decodes,
                                   block_tables=dev[f"block_tables{g}"], seq_lens=dev["seq_lens"],
                                   query_start_loc=dev["query_start_loc"], max_query_len=int(qlens.max()),
                                   chain_pos=dev.get("chain_pos"))
                 for g in range(len(self.windows))]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queues the step's forward and sampling; returns without waiting for the device.
        `prev` is the step before, whose sampled tokens some decode rows take as input."""
        t0 = time.perf_counter()
        step = self.flatten(out, prev)
        lora_slots = None
        if self.lora is not None:  # (rows in the step's order: a request's rows together; none: no adapter row)
            lora_slots = ([sr.request.lora_slot for sr in out.scheduled for _ in range(sr.num_tokens)]
                          if any(sr.request.lora_slot >= 0 for sr in out.scheduled) else [])
            self.lora.rows.set(lora_slots)
        score_rows = [r0 + j for _, _, r0, ts in step.prompt_scores for j in range(len(ts))]  # hidden rows
        dev = self.device
        rows = step.logits_rows
        pending = None
        if step.pending:
            dst, src = zip(*step.pending)
            pending = (torch.tensor(dst).to(dev, non_blocking=True), prev.tokens,
                       torch.tensor(src).to(dev, non_blocking=True))
        graphed = (self.graphs is not None and step.num_decodes == len(step.rows) and not step.pooling
                   and self.graphs.fits(len(step.rows)))
        events = None
        if self.time_steps and dev.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if graphed:
            t1 = time.perf_counter()
            hidden = self.graphs.run(step, pending)
        else:
            meta = self._metadata(step)
            ids = torch.tensor(step.input_ids, dtype=torch.long).to(dev, non_blocking=True)
            if pending is not None:
                dst, tokens, src = pending
                ids[dst] = tokens[src]
            pos = torch.tensor(step.positions, dtype=torch.long).to(dev, non_blocking=True)
            if self.broadcast is not None:
                self.ranks_mid_step = True
                self.broadcast.send(step, score_rows, ids, lora_slots, self.lora.take_fills() if self.lora else ())
            t1 = time.perf_counter()
            hidden = self.model(ids, pos, meta)
        # (a graph's output is overwritten by its next replay)
        kept = None if not self.keep_hidden else hidden.clone() if graphed else hidden
        prompt_sample = self._score_prompts(hidden, step.prompt_scores, score_rows) if score_rows else None
        pooled = pool(hidden, step.pooling) if step.pooling else []
        sample = None
        if step.sampling:
            if len(rows) != hidden.shape[0] or rows[-1] != len(rows) - 1:
                hidden = hidden[torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)]
            logits = self.model.compute_logits(hidden)
        self.ranks_mid_step = False  # the step's last collective is done
        if step.sampling:
            try:
                sample = self.sampler.sample(logits, step.sampling)
            except Exception:  # noqa: BLE001  (find the rows at fault; the others go on)
                sample = self.sampler.sample_each(logits, step.sampling)
            tokens = sample.tokens  # the next step's pending inputs read this copy, on the device
        else:
            tokens = None
        if events is not None:
            events[1].record()
        if sample is not None:
            sample.start_copy()
        return LaunchedStep(sample, tokens, step.sampling, t1 - t0, time.perf_counter() - t1,
                            step.prompt_scores, prompt_sample, events, pooled, kept)

    @torch.inference_mode()
    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run the steps rank 0 broadcasts, until it stops.
        The forward, and the LM head on the same rows as rank 0's (its logits are gathered
        there): prompt rows scored, then the rows sampled."""
        while (received := self.broadcast.recv()) is not None:
            step, score_rows, ids, lora_slots, fills = received
            if self.lora is not None:
                for slot, ident, path in fills:
                    self.lora.fill_from(slot, ident, path)
                self.lora.rows.set(lora_slots)
            pos = torch.tensor(step.positions, dtype=torch.long).to(self.device)
            hidden = self.model(ids.to(self.device), pos, self._metadata(step))
            for _ in self._score_logits(hidden, torch.tensor(score_rows, dtype=torch.long, device=hidden.device)):
                pass
            if step.logits_rows:
                self.model.compute_logits(hidden[torch.tensor(step.logits_rows, dtype=torch.long, device=hidden.device)])

    _SCORE_ROWS = 512  # prompt positions whose logits exist at once (512 x vocab float32)

    def _metadata(self, step: StepInputs) -> AttentionMetadata:
        return self._kernel_metadata(step) if self.use_kernels else self._torch_metadata(step)

    def _score_logits(self, hidden: torch.Tensor, rows: torch.Tensor):
        """The logits of hidden[rows], _SCORE_ROWS rows at a time (with tensor parallelism every rank
        runs these LM-head calls, in this order)."""
        for i in range(0, len(rows), self._SCORE_ROWS):
            yield self.model.compute_logits(hidden[rows[i:i + self._SCORE_ROWS]])

    def _score_prompts(self, hidden: torch.Tensor, scores: list[tuple], score_rows: list[int]) -> DeviceSample:
        """The logprobs of the next prompt token at each scored position (hidden rows `score_rows`;
        raw logits, as vLLM's prompt logprobs), read back like sampled tokens'."""
        dev = hidden.device
        rows = torch.tensor(score_rows, dtype=torch.long).to(dev, non_blocking=True)
        targets = torch.tensor([t for _, _, _, ts in scores for t in ts], dtype=torch.long).to(dev, non_blocking=True)
        counts = [req.params.prompt_logprobs for req, _, _, ts in scores for _ in ts]
        n = self._SCORE_ROWS
        parts = [token_logprobs(logits.float(), targets[i:i + n], max(counts))
                 for i, logits in zip(range(0, len(rows), n), self._score_logits(hidden, rows))]
        return DeviceSample(targets, list(range(len(counts))), counts,
                            tuple(torch.cat(p) for p in zip(*parts))).start_copy()

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Waits for a launched step and returns its sampled tokens."""
        t0 = time.perf_counter()
        result = RunnerOutput(prepare_time=launched.prepare_time, hidden=launched.hidden)
        if launched.sample is not None:
            failed = launched.sample.failed
            for i, (req, tok) in enumerate(zip(launched.sampling, launched.sample.to_host())):
                rid = req.request_id
                if i in failed:
                    result.failed[rid] = failed[i]
                elif isinstance(req, DraftPosition):
                    # Verification: a draft's row counts if every row before it did and the token
                    # sampled there is the draft. Sampling each row from the target's distribution
                    # and keeping the match is rejection sampling for a deterministic draft (kept
                    # with probability p(draft); otherwise the row's token is drawn from p without
                    # the draft); for greedy rows it is the argmax match.
                    out = result.sampled.get(rid)
                    if out is not None and len(out) == req.index and out[-1].token_id == req.token:
                        out.append(tok)
                else:
                    result.sampled[rid] = [tok]
        if launched.prompt_sample is not None:
            scored, i = launched.prompt_sample.to_host(), 0
            for req, first, _, targets in launched.prompt_scores:
                result.prompt_logprobs[req.request_id] = (first, scored[i:i + len(targets)])
                i += len(targets)
        for rid, vector in launched.pooled:
            result.pooled[rid] = vector.tolist()
        if launched.events is not None:
            start, end = launched.events
            end.synchronize()
            result.device_time = start.elapsed_time(end) / 1e3
        result.forward_time = launched.launch_time + time.perf_counter() - t0
        return result

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(out))
