"""Turns a SchedulerOutput into one flattened varlen forward and samples the rows that end.

The KV cache is allocated here once, per layer, and bound to the model's attention layers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pocketllm.engine.scheduler import SchedulerOutput
from pocketllm.layers.attention import AttentionMetadata, PrefillSpan
from pocketllm.models.base import CausalLM
from pocketllm.runner.sampler import SampledToken, Sampler


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    forward_time: float = 0.0  # seconds spent in the model and sampler
    prepare_time: float = 0.0  # seconds spent building inputs


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled KV memory. On the CPU it comes from calloc (numpy), whose large blocks are
    lazily zeroed pages: the cache becomes resident only as requests fill it. (Zeros, not
    garbage: masked slots are still read, and NaN * 0 would poison the attention.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * elem, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.device = device
        cfg = model.cfg
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_caches = [_zeros(shape, kv_dtype, device) for _ in range(cfg.num_layers)]
        self.v_caches = [_zeros(shape, kv_dtype, device) for _ in range(cfg.num_layers)]
        model.bind_kv_cache(self.k_caches, self.v_caches)
        self.sampler = Sampler(seed)

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.cfg
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def prepare(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling = []
        dec_tables, dec_lens = [], []
        prefills: list[tuple[int, int, int, list[int]]] = []
        # Query-length-1 rows come first; they are most of a busy step, so they get a lean loop.
        for sr in out.scheduled[:out.num_decodes]:
            req = sr.request
            p, blocks, tokens = req.num_computed_tokens, req.block_ids, req.all_token_ids
            input_ids.append(tokens[p])
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            dec_tables.append(blocks)  # exactly ceil((p + 1) / bs) blocks: the allocation's invariant
            dec_lens.append(p + 1)
            if p + 1 == len(tokens):
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)
        for sr in out.scheduled[out.num_decodes:]:
            req, n = sr.request, sr.num_tokens
            start, blocks = req.num_computed_tokens, req.block_ids
            q0 = len(input_ids)
            input_ids += req.all_token_ids[start:start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [blocks[p // bs] * bs + p % bs for p in pos]
            ctx = start + n
            prefills.append((q0, n, ctx, blocks[:-(-ctx // bs)]))
            if sr.samples:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=out.num_decodes, decode_block_tables=None, decode_mask=None,
            prefills=[self._prefill_span(*p) for p in prefills])
        if dec_tables:
            width = max(len(t) for t in dec_tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables],
                                                    dtype=torch.long, device=dev)
            lens = torch.tensor(dec_lens, device=dev)
            meta.decode_mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        return ids, pos, meta, rows, sampling

    def _prefill_span(self, q0: int, n: int, ctx: int, blocks: list[int]) -> PrefillSpan:
        dev = self.device
        q_pos = torch.arange(ctx - n, ctx, device=dev)[:, None]
        mask = torch.arange(ctx, device=dev)[None, :] <= q_pos
        return PrefillSpan(q0, n, ctx, torch.tensor(blocks, dtype=torch.long, device=dev), mask)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        ids, pos, meta, rows, sampling = self.prepare(out)
        t1 = time.perf_counter()
        hidden = self.model(ids, pos, meta)
        result = RunnerOutput(prepare_time=t1 - t0)
        if sampling:
            logits = self.model.compute_logits(hidden[rows])
            for req, tok in zip(sampling, self.sampler(logits, sampling)):
                result.sampled[req.request_id] = tok
        result.forward_time = time.perf_counter() - t1
        return result
