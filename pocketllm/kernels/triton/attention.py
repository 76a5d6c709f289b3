"""Paged attention over a block-table KV cache: one kernel for decode rows and prefill chunks.

Layout (as in pocketllm.layers.attention): K/V caches [num_blocks, block_size, Hkv, D]; the
step's queries are flattened [T, Hq, D] with request r owning rows
query_start_loc[r]:query_start_loc[r+1]; seq_lens[r] counts its tokens including this step's,
so the chunk sits at positions seq_lens[r] - q_len .. seq_lens[r] - 1 and attends causally
to everything before it (cached prefix included).

Each program takes BLOCK_Q query tokens of one request and the GROUP query heads that share
one KV head (GQA packing: the tile has BLOCK_Q * GROUP rows, so K/V are read once per group).
Programs find their request by binary search over query_start_loc, so the grid depends only
on (num_tokens, num_seqs): the decode launch is CUDA-graph capturable.

In decode steps whose keys are not split, the rows of one request (its last token and its drafts:
consecutive positions) are taken in runs of BLOCK_Q by one program, which reads their keys once.

Decode batches too small to fill the GPU (num_seqs * Hkv programs) split each sequence's keys
into NUM_SPLITS ranges (flash-decoding): each program writes its unnormalised partial result
with its running max and sum, and the last program of a (query block, KV head) to finish merges
its splits (a ticket counter; a second kernel where the output's 8-bit form is wanted too). The number of splits is
DECODE_SPLITS for every such batch, not a function of its size, so a row's keys are cut by its
own length alone and its output has the same bits in a step of 1 row as in any other step that
splits (what speculative verification needs: a request's drafts are rows of one step).
"""
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pocketllm.core.kv_dtype import quant_of

from .int8_act import attach, buffers_for, kernel_args, store_groups


@triton.jit
def _find_seq(query_start_loc, qb, num_seqs, BLOCK_Q: tl.constexpr):
    # Request r's first query block has global index query_start_loc[r] // BLOCK_Q + r.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache, v_cache, k_scale, v_scale, out_ptr, part_acc, part_ml, tickets, block_tables, seq_lens,
        query_start_loc, sinks, chain_pos, scale, softcap, window, num_seqs, num_q_heads,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_sb, stride_ss,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        KV_BLOCK: tl.constexpr, TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr, RUN: tl.constexpr,
        BLOCK_M: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
        PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr, CHAINS: tl.constexpr, MERGE: tl.constexpr,
        QUANT_KV: tl.constexpr):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc, qb, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    local_qb = qb - (q_start // BLOCK_Q + seq)
    if local_qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens before this step's chunk
    table_row = seq
    if CHAINS:  # decode rows, one a request: a run of one request's rows (chain_pos 0, 1, ..) in one program
        first = tl.load(chain_pos + seq)
        if first % BLOCK_Q != 0:
            return  # (its run's first row takes it)
        run = tl.arange(0, RUN)  # BLOCK_Q rounded up to a power of two (3 heads a group: 5 rows)
        nxt = seq + run
        q_len = tl.sum((tl.load(chain_pos + nxt, mask=(nxt < num_seqs) & (run < BLOCK_Q), other=-1)
                        == first + run).to(tl.int32), 0)
        table_row = seq + q_len - 1  # the last row's table covers every key of the run
        seq_len = context + q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = local_qb * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + q_tok

    # Keys this tile can see: up to its last query's position; with a window, from the first
    # query's position - window + 1 (kv_lo). Tiles start on a TILE_N boundary, but no table entry
    # or key before kv_lo is loaded: a sliding group's blocks behind the window are released.
    kv_end = tl.minimum(seq_len, context + (local_qb + 1) * BLOCK_Q)
    kv_begin = 0
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + local_qb * BLOCK_Q - window + 1, 0)
        kv_begin = (kv_lo // TILE_N) * TILE_N
    if NUM_SPLITS > 1:
        span = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), TILE_N) * TILE_N
        kv_begin = kv_begin + split * span
        kv_end = tl.minimum(kv_end, kv_begin + span)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the head's sink logit starts the softmax (in the first split only): exp(0) = 1, no value
        sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_begin, kv_end, TILE_N):
        k_pos = start + offs_n
        n_ok = k_pos < kv_end
        if USE_WINDOW:
            n_ok = n_ok & (k_pos >= kv_lo)
        phys = tl.load(block_tables + table_row * stride_bt + k_pos // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        slot_in = k_pos % KV_BLOCK
        k = tl.load(k_cache + phys[:, None] * stride_kb + slot_in[:, None] * stride_ks + kvh * stride_kh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT_KV:  # 8-bit values, exact in q's dtype; a score takes its key's scale
            k_sc = tl.load(k_scale + phys * stride_sb + slot_in * stride_ss + kvh, mask=n_ok, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (scale * k_sc[None, :])
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            # tanh(x) = 2 * sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + phys[:, None] * stride_vb + slot_in[:, None] * stride_vs + kvh * stride_vh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT_KV:  # a weight takes its value's scale
            v_sc = tl.load(v_scale + phys * stride_sb + slot_in * stride_ss + kvh, mask=n_ok, other=0.0)
            pv = tl.dot((p * v_sc[None, :]).to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + q_tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partial results [T, Hq, NUM_SPLITS, (D | max, sum)]
        part = ((q_start + q_tok).to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml + part * 2, m_i, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)
        if MERGE:  # the last of the splits to finish merges them (no second launch)
            tl.debug_barrier()  # every thread's partials stored before the ticket (a release at GPU scope)
            ticket = tickets + qb * tl.num_programs(1) + kvh
            if tl.atomic_add(ticket, 1, sem="acq_rel") == NUM_SPLITS - 1:
                first = part - split
                o = _merge(part_acc, part_ml, first, row_ok, offs_d, d_ok, HEAD_DIM, BLOCK_M, BLOCK_D, NUM_SPLITS)
                tl.store(out_ptr + (q_start + q_tok)[:, None] * stride_ot + head[:, None] * stride_oh
                         + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
                tl.atomic_xchg(ticket, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _merge(part_acc, part_ml, first, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The rows' output from their NUM_SPLITS partials (``first``: each row's split 0), splits added in
    order; read past L1 (other programs wrote them)."""
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_ml + (first + s) * 2, mask=row_ok, other=float("-inf"),
                                          cache_modifier=".cg"))
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(part_ml + (first + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml + (first + s) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_ref))
        total += l_s * w
        acc = tl.load(part_acc + (first + s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        o += acc * w[:, None]
    return o / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_splits_kernel(part_acc, part_ml, out_ptr, xq_ptr, xd_ptr, xs_ptr, stride_q, stride_d, stride_ot,
                         stride_oh, num_q_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, INT8: tl.constexpr):
    """One row's head: its splits merged as the attention kernel's last split merges them (the same bits),
    and its 8-bit form."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    first = (t * num_q_heads + h) * NUM_SPLITS + tl.zeros([1], tl.int64)
    o = _merge(part_acc, part_ml, first, first >= 0, offs_d, d_ok, HEAD_DIM, 1, BLOCK_D, NUM_SPLITS)
    o = tl.reshape(o, [BLOCK_D]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o, mask=d_ok)
    if INT8:  # the head's groups of the row's 8-bit form (HEAD_DIM a multiple of 32, BLOCK_D = HEAD_DIM)
        store_groups(o.to(tl.float32), xq_ptr, xd_ptr, xs_ptr, t, h * HEAD_DIM, num_q_heads * HEAD_DIM, stride_q,
                     stride_d, BLOCK_D)


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H100/H200
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


DECODE_SPLITS = 16
MAX_TICKETS = 1 << 16


@cache
def _tickets(device: torch.device) -> torch.Tensor:
    """int32 zeros, one a (query block, KV head) of a split launch (each reset after use); made once a device,
    before any graph captures it."""
    return torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key splits per decode row: DECODE_SPLITS where one program per (row, KV head) would fill at
    most one of each multiprocessor's two program slots, else none."""
    return DECODE_SPLITS if num_seqs * num_kv_heads <= num_sms(device) else 1


# Query heads a program takes of a head wider than 256 (MLA's 576-wide latent, BLOCK_D 1024): more do
# not fit sm_90's registers and shared memory (tests/test_triton_gguf.py compiles the tiles), so a
# latent head that serves more (DeepSeek-V3's 128) is read by several programs, each a tile of heads.
WIDE_GROUP = 32


def tile_config(head_dim: int, kv_block: int, quant: bool, rows: int = 16) -> dict:
    """Keys per loop step and the launch's warps and pipeline stages (benchmarks/tools/attention_tiles.py
    sweeps them) for tiles of `rows` query rows. An 8-bit cache takes tiles of 128 keys in two stages at
    head_dim <= 128: the values' conversion, not the bytes, bounds it, and the default tile ran its decode
    1.5x and its prefill 1.7x slower (benchmarks/results/h100-kv-offload.md); 16-bit caches are at the
    memory's rate already. Heads wider than 256 take 16 keys a step, the most sm_90 holds at 1,024 columns."""
    if head_dim > 256:
        return {"TILE_N": max(kv_block, 16), "num_warps": 8, "num_stages": 2 if rows <= 16 else 1}
    if quant and head_dim <= 128:
        return {"TILE_N": max(kv_block, 128), "num_warps": 4, "num_stages": 2}
    return {"TILE_N": max(kv_block, 32 if head_dim > 64 else 64), "num_warps": 4, "num_stages": 3}


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float, window: int | None = None,
                    softcap: float | None = None, out: torch.Tensor | None = None,
                    num_splits: int | None = None, sinks: torch.Tensor | None = None,
                    int8_rows: int = 0, chain_pos: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (any row/head strides, unit last stride) -> out [T, Hq, D]. ``sinks`` [Hq]
    float32: a logit per head in every row's softmax denominator (gpt-oss). Up to ``int8_rows``
    rows, decode steps whose key splits are merged also give the output's 8-bit form
    (``int8_act``: for the output projection's GEMV). ``chain_pos`` [R] int32, decode steps: each row's
    index among its request's consecutive rows (a request with drafts has several); where the keys are
    not split, a program takes a run of one request's rows and reads their keys once (each row the same
    bits as alone: the keys past a row's own are masked out of its softmax, whole tiles of them adding
    exact zeros). ``k_scale``/``v_scale`` [blocks, bs, Hkv] float32: the caches hold 8-bit values
    (int8 or fp8, pocketllm.core.kv_dtype), read as such and scaled in the kernel.

    block_tables [R, W] int32, seq_lens [R] int32, query_start_loc [R + 1] int32; the step's
    K/V must already be in the cache. With a window, entries for blocks wholly before each tile's
    first visible key are never read (they may be placeholders). `max_query_len` only picks the tile shape (and, when
    it is 1, how many key splits run; `num_splits` overrides that).
    """
    t, hq, d = q.shape
    _, kv_block, hkv, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and hq % hkv == 0
    if d > 256 and hq // hkv > WIDE_GROUP:  # tiles of WIDE_GROUP heads, each reading the wide head (stride 0)
        assert hkv == 1 and hq % WIDE_GROUP == 0 and k_scale is None, (hq, hkv)
        hkv = hq // WIDE_GROUP
        k_cache, v_cache = (c.expand(-1, -1, hkv, -1) for c in (k_cache, v_cache))
    group = hq // hkv
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    # A decode tile holds one token's heads; prefill tiles take 64 rows (several tokens).
    block_m = max(16, triton.next_power_of_2(group)) if max_query_len == 1 \
        else max(64 if d <= 256 else 32, triton.next_power_of_2(group))
    block_q = block_m // group
    tiles = tile_config(d, kv_block, k_scale is not None, block_m)
    tile_n = tiles["TILE_N"]
    assert tile_n % kv_block == 0
    if num_splits is None:
        num_splits = decode_splits(num_seqs, hkv, q.device) if max_query_len == 1 else 1
    chains = chain_pos is not None and num_splits == 1 and max_query_len == 1
    part_acc = part_ml = out  # unused without splits
    grid = (t // block_q + num_seqs, hkv, num_splits)
    x8 = None
    if num_splits > 1:
        part_acc = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((t, hq, num_splits, 2), dtype=torch.float32, device=q.device)
        if d % 32 == 0 and d == triton.next_power_of_2(d) and out.is_contiguous():
            x8 = buffers_for(out.view(t, hq * d), int8_rows)
    # The splits merged by the last to finish, unless the output's 8-bit form is wanted too (the merge
    # kernel writes it). Which path a step takes depends on its shape alone: the same rows, the same bits.
    merge = num_splits > 1 and x8 is None
    assert not merge or grid[0] * hkv <= MAX_TICKETS, grid
    tickets = _tickets(q.device) if merge else seq_lens
    quant = k_scale is not None
    if quant:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
        assert k_scale.stride(2) == 1
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale if quant else out, v_scale if quant else out, out, part_acc, part_ml, tickets,
        block_tables, seq_lens, query_start_loc,
        out if sinks is None else sinks, chain_pos if chains else seq_lens, scale, softcap or 0.0, window or 0,
        num_seqs, hq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(max(d, 16)),
        KV_BLOCK=kv_block, TILE_N=tile_n, BLOCK_Q=block_q, RUN=triton.next_power_of_2(block_q), BLOCK_M=block_m,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None, USE_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact: no TF32
        NUM_SPLITS=num_splits, CHAINS=chains, MERGE=merge, QUANT_KV=quant,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    if num_splits > 1 and not merge:
        _merge_splits_kernel[(t, hq)](part_acc, part_ml, out, *kernel_args(x8, out), out.stride(0), out.stride(1),
                                      hq, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), NUM_SPLITS=num_splits,
                                      INT8=x8 is not None)
        if x8 is not None:
            attach(out, x8)
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_mapping, stride_kt, stride_vt,
                     stride_cs, stride_vcs, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch: it owns no KV
        return
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    tl.store(k_cache + slot * stride_cs + offs, tl.load(k_ptr + t * stride_kt + offs, mask=ok), mask=ok)
    tl.store(v_cache + slot * stride_vcs + offs, tl.load(v_ptr + t * stride_vt + offs, mask=ok), mask=ok)


@triton.jit
def _quantize_heads(x_ptr, cache, scales, slot, stride_cs, HKV: tl.constexpr, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
    """A token's HKV heads of D values into its cache slot as 8-bit values and a float32 scale a head
    (pocketllm.core.kv_dtype's reference: scale = amax / QMAX, int8 rounded to the nearest even)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + offs_h[:, None] * D + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.max(tl.abs(x), 1) / QMAX
    y = x * tl.where(s > 0.0, 1.0 / s, 0.0)[:, None]
    if INT8:
        f = tl.floor(y)
        odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 where f is odd
        r = f + tl.where(y - f > 0.5, 1.0, tl.where(y - f < 0.5, 0.0, odd))
        values = tl.minimum(tl.maximum(r, -127.0), 127.0).to(cache.dtype.element_ty)
    else:
        values = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(cache.dtype.element_ty)
    tl.store(cache + slot * stride_cs + offs_h[:, None] * D + offs_d[None, :], values, mask=ok)
    tl.store(scales + slot * HKV + offs_h, s, mask=offs_h < HKV)


@triton.jit
def _write_kv_quant_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scale, v_scale, slot_mapping, stride_kt, stride_vt,
                           stride_cs, stride_vcs, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    _quantize_heads(k_ptr + t * stride_kt, k_cache, k_scale, slot, stride_cs, HKV, D, BLOCK_H, BLOCK_D, QMAX, INT8)
    _quantize_heads(v_ptr + t * stride_vt, v_cache, v_scale, slot, stride_vcs, HKV, D, BLOCK_H, BLOCK_D, QMAX, INT8)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k/v [T, Hkv, D] (heads contiguous within a row) -> cache slots; slot -1 is skipped. With scales
    [blocks, bs, Hkv] (contiguous), the caches are 8-bit: each head quantized with its scale."""
    t, hkv, d = k.shape
    assert k.stride(1) == d and v.stride(1) == d and k.stride(2) == 1 and v.stride(2) == 1
    if k_scale is not None:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_cache.stride(1) == v_cache.stride(1)
        quant = quant_of(k_cache.dtype)
        _write_kv_quant_kernel[(t,)](k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, k.stride(0),
                                     v.stride(0), k_cache.stride(1), v_cache.stride(1), HKV=hkv, D=d,
                                     BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
                                     QMAX=quant.qmax, INT8=quant.storage == torch.int8)
        return
    assert k.dtype == k_cache.dtype
    row = hkv * d
    _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                           k_cache.stride(1), v_cache.stride(1), ROW=row, BLOCK=triton.next_power_of_2(row))
