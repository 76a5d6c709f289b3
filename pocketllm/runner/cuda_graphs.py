"""CUDA graphs of the decode forward, one per batch-size bucket.

A pure-decode step is padded to the smallest bucket that holds it and replays that bucket's
graph. Inputs live in persistent device buffers that each step overwrites (through pinned
staging buffers, without a host sync); padding rows write no KV (slot -1) and attend to one
stale slot, so their outputs are finite and ignored. All graphs share one memory pool; the
hidden states a replay returns stay valid until the next replay. Each KV group (a model with
sliding-window layers has several) has its own static slots and block tables. With LoRA adapters
each bucket has a second graph, with the adapters' kernels, for steps where some row has one: their
rows and slots are in the LoRARows' fixed buffers, so one graph serves every mix.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from pocketllm.layers.attention import AttentionMetadata
from pocketllm.models.base import CausalLM


def buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16 if max_batch <= 256 else 32))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: CausalLM, device: torch.device, max_batch: int, max_blocks: int,
                 windows: tuple[int | None, ...] = (None,), lora_rows=None):
        self.model = model
        self.lora_rows = lora_rows  # (layers.lora.LoRARows)
        self.windows = windows  # per KV group
        num_groups = len(windows)
        self.sizes = buckets(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        n = max_batch

        def buffers(dtype, *shape):
            return (torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, pin_memory=True))

        self.ids, self.ids_h = buffers(torch.long, n)
        self.pos, self.pos_h = buffers(torch.long, n)
        self.seq_lens, self.seq_lens_h = buffers(torch.int32, n)
        self.chain_pos, self.chain_pos_h = buffers(torch.int32, n)  # (StepInputs.chain_pos; padding rows 0)
        # per KV group: slots [n] and block tables [n, max_blocks]
        self.slots, self.slots_h = zip(*(buffers(torch.long, n) for _ in range(num_groups)))
        self.tables, self.tables_h = zip(*(buffers(torch.int32, n, max_blocks) for _ in range(num_groups)))
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        for slots in self.slots:
            slots.fill_(-1)
        self.seq_lens.fill_(1)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (rows, adapters)
        self._copied: torch.cuda.Event | None = None  # the staging buffers are free once it fires
        self._capture_all(device)

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _meta(self, b: int) -> AttentionMetadata:
        metas = [AttentionMetadata(slot_mapping=slots[:b], num_decodes=b, block_tables=tables[:b],
                                   seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
                                   max_query_len=1, chain_pos=self.chain_pos[:b])
                 for slots, tables in zip(self.slots, self.tables)]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                for adapters in (False, True) if self.lora_rows is not None else (False,):
                    with self.lora_rows.capturing(b) if adapters else contextlib.nullcontext():
                        meta = self._meta(b)
                        self.model(self.ids[:b], self.pos[:b], meta)  # compiles the kernels, warms cuBLAS
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=stream):
                            hidden = self.model(self.ids[:b], self.pos[:b], meta)
                    self.graphs[b, adapters] = (graph, hidden)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    def run(self, step, pending=None) -> torch.Tensor:
        """Replays the bucket for `step` (a runner StepInputs of decode rows) -> hidden [n, H].
        `pending` = (rows, tokens, index): input ids to take from the device (ids[rows] = tokens[index])."""
        n = len(step.rows)
        b = next(s for s in self.sizes if s >= n)
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the last step read its tokens back
        self.ids_h[:n] = torch.as_tensor(step.input_ids)
        self.pos_h[:n] = torch.as_tensor(step.positions)
        lens = self.seq_lens_h.numpy()
        lens[:n] = [ctx for _, ctx in step.rows]
        lens[n:b] = 1
        chain = self.chain_pos_h.numpy()
        chain[:n] = step.chain_pos or 0
        chain[n:b] = 0
        for dst, src in ((self.ids, self.ids_h), (self.pos, self.pos_h), (self.seq_lens, self.seq_lens_h),
                         (self.chain_pos, self.chain_pos_h)):
            dst[:b].copy_(src[:b], non_blocking=True)
        for g, rows in enumerate(step.tables):
            self.slots_h[g][:n] = torch.as_tensor(step.slots[g])
            self.slots_h[g][n:b] = -1
            tables = self.tables_h[g].numpy()
            for i, blocks in enumerate(rows):
                tables[i, :len(blocks)] = blocks
            width = max(len(blocks) for blocks in rows)
            if self.windows[g] is not None:
                # Entries behind the window are never read by these rows, but stale ones are read
                # by later padding rows (their one key): no NO_BLOCK may stay in the static table.
                np.maximum(tables[:n, :width], 0, out=tables[:n, :width])
            self.slots[g][:b].copy_(self.slots_h[g][:b], non_blocking=True)
            self.tables[g][:n, :width].copy_(self.tables_h[g][:n, :width], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if pending is not None:
            dst, tokens, src = pending
            self.ids[dst] = tokens[src]
        graph, hidden = self.graphs[b, self.lora_rows is not None and self.lora_rows.active]
        graph.replay()
        return hidden if n == b else hidden[:n]  # the whole output keeps the form its norm wrote (int8_act)
