"""Paged attention over a block-table KV cache: plain torch on the CPU (and the reference for
the GPU kernels), the Triton kernels of pocketllm.kernels.triton on CUDA.

Each layer has K and V caches shaped [num_blocks, block_size, num_kv_heads, head_dim] (shared
with layers of other KV groups, which use other block ids) and reads its KV group's block table:
a token at position p of a request lives in slot block_ids[p // bs] * bs + p % bs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pocketllm.core.kv_dtype import dequantize, quant_of, quantize


@dataclass
class PrefillSpan:
    """One request with a query longer than one token: a prefill chunk."""

    query_start: int
    query_len: int
    # key positions read: the chunk and the prefix it sees (a sliding group's from the block where
    # its window starts; block_ids and mask count from there too)
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / bs)]
    mask: torch.Tensor  # [query_len, context_len] bool, causal with the prefix offset


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer of a KV group; the first
    group's holds all of them (`groups`, when there are several). The torch path reads the
    per-request masks and spans; the kernel path reads the flat tensors (graph-capturable)."""

    slot_mapping: torch.Tensor  # [T] where each token's K/V is written (-1: nowhere)
    num_decodes: int  # the first rows have query length 1
    # torch path
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * bs] bool
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64 context lengths (the CPU kernels)
    # A sliding group's torch tables start at each row's window and its masks are cut to it: the
    # window they hold (None: tables from position 0, causal masks).
    window: int | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # kernel path: every request of the step, decodes first
    block_tables: torch.Tensor | None = None  # [R, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [R] int32, tokens including this step's
    query_start_loc: torch.Tensor | None = None  # [R + 1] int32
    max_query_len: int = 0
    # decode steps: each row's index among its request's consecutive rows (drafts: 0, 1, ..), which the
    # kernel reads keys once for
    chain_pos: torch.Tensor | None = None  # [R] int32
    groups: list[AttentionMetadata] | None = None  # per KV group (this one first), if several
    # Sliding-window layers of a full group read a narrower mask, made from the same metadata on first use.
    _window_masks: dict | None = None

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step (one KV group, torch path) as two: its decode rows' metadata and its prefill
        chunks', each counting its rows from 0. Rows of different requests are independent, so the
        two may run apart (the CPU's one-call decoder takes the first)."""
        assert self.groups is None and self.decode_lens is not None and self.prefills
        n = self.num_decodes
        decodes = replace(self, slot_mapping=self.slot_mapping[:n], prefills=[], _window_masks=None)
        chunks = replace(self, slot_mapping=self.slot_mapping[n:], num_decodes=0, decode_block_tables=None,
                         decode_mask=None, decode_lens=None, _window_masks=None,
                         prefills=[replace(p, query_start=p.query_start - n) for p in self.prefills])
        return decodes, chunks

    @property
    def cpu_decode_only(self) -> bool:
        """Every row decodes and the CPU kernels' context lengths are there (their one-call paths)."""
        return self.decode_lens is not None and not self.prefills

    def windowed(self, window: int) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Masks for a layer that sees only the last `window` positions (itself included)."""
        assert self.window is None, "masks already cut to a window"
        if self._window_masks is None:
            self._window_masks = {}
        if window not in self._window_masks:
            dec = None
            if self.decode_mask is not None:
                lens = self.decode_mask.sum(-1, keepdim=True)  # context length per row
                idx = torch.arange(self.decode_mask.shape[-1], device=lens.device)
                dec = self.decode_mask & (idx > lens - 1 - window)
            pre = []
            for span in self.prefills:
                dev = span.mask.device
                q_pos = torch.arange(span.context_len - span.query_len, span.context_len, device=dev)[:, None]
                k_pos = torch.arange(span.context_len, device=dev)[None, :]
                pre.append(span.mask & (k_pos > q_pos - window))
            self._window_masks[window] = (dec, pre)
        return self._window_masks[window]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k/v [T, Hkv, D] into the caches' slots; an 8-bit cache (scales given) takes them quantized."""
    nb, bs, h, d = k_cache.shape
    if k_scale is None:
        k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    quant = quant_of(k_cache.dtype)
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        values, s = quantize(x, quant)
        # (as bytes: index_copy_ has no float8 kernel on the CPU)
        cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, values.view(torch.uint8))
        scales.view(nb * bs, h).index_copy_(0, slot_mapping, s)


def _blocks(cache: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype,
            cpu_fused: bool = False) -> torch.Tensor:
    """Blocks `ids` of a cache [blocks, bs, Hkv, D], an 8-bit one's dequantized (the gathered copy, not the
    cache; on the CPU fast path in one C pass, the same values)."""
    if scales is None:
        return cache.index_select(0, ids)
    if cpu_fused and cache.dtype == torch.int8 and dtype == torch.float32:
        from pocketllm.kernels.cpu import layer_ops

        return layer_ops.gather_int8_blocks(cache, scales, ids)
    values = cache.view(torch.uint8).index_select(0, ids).view(cache.dtype)
    return dequantize(values, scales.index_select(0, ids), dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    cpu_fused: bool = False, sinks: torch.Tensor | None = None,
                    int8_rows: int = 0, kv_written: bool = False, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> output [T, Hq, D]. `cpu_fused`:
    the CPU fast path writes the cache and attends the decode rows in C (layer_ops). `sinks`
    [Hq] float32: a logit per head that joins every row's softmax and attends to nothing (gpt-oss).
    `int8_rows`: the kernels' (see kernels.triton.attention.paged_attention). `kv_written`: the
    kernels' path, k and v already in the cache (the rotary kernel wrote them). `k_scale`/`v_scale`
    [blocks, bs, Hkv] float32: the caches hold 8-bit values (pocketllm.core.kv_dtype)."""
    if meta.block_tables is not None:
        from pocketllm.kernels.triton import attention as kernels

        if not kv_written:
            kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.max_query_len, scale, window, softcap,
                                       sinks=sinks, int8_rows=int8_rows, chain_pos=meta.chain_pos,
                                       k_scale=k_scale, v_scale=v_scale)
    n = meta.num_decodes
    if cpu_fused:
        from pocketllm.kernels.cpu import layer_ops

        layer_ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        if not meta.prefills:
            return layer_ops.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                              scale, window, softcap, sinks, k_scale, v_scale)
    else:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    nb, bs, hkv, d = k_cache.shape
    out = torch.empty_like(q)
    dec_mask, pre_masks = (meta.decode_mask, [s.mask for s in meta.prefills]) if window == meta.window \
        else meta.windowed(window)
    if n and cpu_fused:
        out[:n] = layer_ops.decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                             scale, window, softcap, sinks, k_scale, v_scale)
    elif n:
        tables = meta.decode_block_tables
        # index_select, not k_cache[tables]: advanced indexing is far slower on large caches.
        flat = tables.reshape(-1)
        kd = _blocks(k_cache, k_scale, flat, q.dtype).view(n, -1, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
        vd = _blocks(v_cache, v_scale, flat, q.dtype).view(n, -1, hkv, d).transpose(1, 2)
        out[:n] = _sdpa(q[:n].unsqueeze(2), kd, vd, dec_mask, scale, softcap, sinks).squeeze(2)
    for span, mask in zip(meta.prefills, pre_masks):
        s, ql, cl = span.query_start, span.query_len, span.context_len
        kp = _blocks(k_cache, k_scale, span.block_ids, q.dtype, cpu_fused).view(-1, hkv, d)[:cl].transpose(0, 1)[None]
        vp = _blocks(v_cache, v_scale, span.block_ids, q.dtype, cpu_fused).view(-1, hkv, d)[:cl].transpose(0, 1)[None]
        qp = q[s:s + ql].transpose(0, 1).unsqueeze(0)  # [1, Hq, ql, D]
        out[s:s + ql] = _sdpa(qp, kp, vp, mask, scale, softcap, sinks)[0].transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
          softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                              scale=scale, enable_gqa=True)
    # Soft-capped scores (Gemma 2 style) and sinks need the explicit path.
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.matmul(torch.softmax(torch.cat((scores, sink), -1), dim=-1)[..., :-1].to(q.dtype), v)
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
