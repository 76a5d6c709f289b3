"""The Triton kernels of the CUDA path against the torch implementations they replace.

On a GPU they run for real; on the CPU (CI) they run under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), which checks the same kernel code on small shapes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pocketllm.kernels.triton import attention as kattn
from pocketllm.kernels.triton import fused
from pocketllm.layers.rotary import _rotate, inv_frequencies

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, msg=None) -> None:
    """Bit-equality of compiled kernels. Under the interpreter tl.dot is numpy's matmul, whose bits
    depend on where a row sits in its tile on some BLAS kernels (OpenBLAS's Haswell and Zen ones:
    OPENBLAS_CORETYPE=Haswell moves a row's bits when it moves within a tile; the SkylakeX one keeps
    them), so there the kernels' rows agree to rounding (a wrong key read is still caught)."""
    if DEV == "cuda":
        assert torch.equal(got, want), msg
    else:
        rounding = 2 ** -16 if got.dtype == torch.float32 else 2 ** -7
        assert not got.isnan().any() and float((got.float() - want.float()).abs().max()) <= rounding * float(
            want.float().abs().max()), msg


def reference_attention(q, k_cache, v_cache, rows, scale, window=None, softcap=None, sinks=None):
    """Dense per-request attention over the cache, from first principles (``sinks`` [Hq]: an extra
    logit per head in the softmax, attending to nothing)."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    q0 = 0
    for qlen, ctx, blocks in rows:
        kk = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:ctx].float().repeat_interleave(group, 1)
        vv = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:ctx].float().repeat_interleave(group, 1)
        qq = q[q0:q0 + qlen].float()
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(ctx - qlen, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
        if sinks is not None:
            s = torch.cat((s, sinks.float()[:, None, None].expand(-1, qlen, 1)), -1)
        p = s.softmax(-1)[..., :ctx]
        out[q0:q0 + qlen] = torch.einsum("hqk,khd->qhd", p, vv)
        q0 += qlen
    assert bs > 0
    return out


def make_step(rows_spec, hq, hkv, d, bs=16, num_blocks=64, dtype=torch.float32, seed=0):
    """rows_spec: [(query_len, context_len)] -> caches with random content, shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for qlen, ctx in rows_spec:
        n = -(-ctx // bs)
        rows.append((qlen, ctx, [free.pop() for _ in range(n)]))
    t = sum(r[0] for r in rows)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    width = max(len(r[2]) for r in rows)
    tables = torch.tensor([r[2] + [0] * (width - len(r[2])) for r in rows], dtype=torch.int32)
    seq_lens = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor([r[0] for r in rows]).cumsum(0)), dtype=torch.int32)
    return q, k_cache, v_cache, rows, tables, seq_lens, qsl


CASES = [
    # (rows (query_len, context_len), Hq, Hkv, head_dim): decodes, prefills, chunks over a prefix
    ([(1, 1), (1, 17), (1, 40)], 4, 2, 32),
    ([(1, 33), (5, 5), (20, 52)], 8, 2, 64),
    ([(1, 9), (1, 70), (37, 37)], 6, 1, 32),  # group of 6: not a power of two
    ([(3, 19), (1, 64), (17, 80)], 8, 8, 128),  # MHA, head_dim 128
]


@pytest.mark.parametrize("rows_spec,hq,hkv,d", CASES)
def test_paged_attention_matches_reference(rows_spec, hq, hkv, d):
    q, kc, vc, rows, tables, lens, qsl = make_step(rows_spec, hq, hkv, d)
    scale = d ** -0.5
    ref = reference_attention(q, kc, vc, rows, scale)
    out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                max(r[0] for r in rows), scale)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [2, 8])
def test_split_key_decode_matches_reference(splits):
    """Flash-decoding: decode rows split over their keys and merged by the last split to finish; a split
    may be empty."""
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 1), (1, 17), (1, 70), (1, 33)], 8, 2, 64, seed=3)
    ref = reference_attention(q, kc, vc, rows, 0.125)
    out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                1, 0.125, num_splits=splits)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)
    assert not kattn._tickets(out.device).any()  # the last split of each merged resets its ticket: replays start at 0
    assert kattn.decode_splits(1, 8, torch.device("cpu")) == 16 and kattn.decode_splits(64, 8, torch.device("cpu")) == 1


@pytest.mark.parametrize("rows_spec,splits", [([(1, 9), (4, 21)], None), ([(1, 9), (1, 20)], 2)])
def test_a_wide_latent_head_serves_its_query_heads_in_tiles(rows_spec, splits):
    """MLA (DeepSeek): one 576-wide head a token, read as keys and as values by 64 query heads, which the
    kernel takes in tiles of WIDE_GROUP heads (V3's 128 do not fit one program on sm_90)."""
    q, kc, _, rows, tables, lens, qsl = make_step(rows_spec, 64, 1, 576, seed=5)
    ref = reference_attention(q, kc, kc, rows, 0.05)
    kc = kc.to(DEV)
    out = kattn.paged_attention(q.to(DEV), kc, kc, tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                max(r[0] for r in rows), 0.05, num_splits=splits)
    assert 64 // kattn.WIDE_GROUP > 1
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)


def test_a_decode_rows_bits_do_not_depend_on_its_step_size():
    """A decode row's keys are split by its own length, not by how many rows its step has: alone or
    as one of five (a request's last token and its drafts, say), it computes the same bits."""
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 200 + i) for i in range(5)], 8, 8, 32, num_blocks=80, seed=4)
    step = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV), 1,
                                 0.2)
    alone = kattn.paged_attention(q[:1].to(DEV), kc.to(DEV), vc.to(DEV), tables[:1].to(DEV), lens[:1].to(DEV),
                                  qsl[:2].to(DEV), 1, 0.2)
    assert torch.equal(step[:1], alone)
    torch.testing.assert_close(step.cpu(), reference_attention(q, kc, vc, rows, 0.2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="bfloat16 dot products need a GPU (the interpreter runs fp32)"))], ids=str)
@pytest.mark.parametrize("hq,hkv,window,sinks", [(8, 2, None, False), (4, 4, 8, True), (6, 1, None, True),
                                               (9, 3, None, False)])  # 3 heads a group: 5-row runs
def test_a_requests_rows_read_their_keys_once_with_the_same_bits(hq, hkv, window, sinks, dtype):
    """Decode rows of one request (its last token and drafts: consecutive positions, each row's table
    cut to its own blocks) taken in runs by one program (``chain_pos``): every row the same bits as
    when each row has its own program, runs longer than a program's rows, rows crossing a block, a
    window and sinks. Table entries past a row's own blocks point at a block of NaN: a run that read
    its first row's table past that row would fail."""
    bs = 8
    runs = [(5, 63), (1, 17), (3, 22), (6, 30), (2, 8)]  # (rows, the first row's length): runs cross blocks
    spec = [(1, first + i) for n, first in runs for i in range(n)]
    q, kc, vc, rows, tables, lens, qsl = make_step(spec, hq, hkv, 32, bs=bs, num_blocks=160, dtype=dtype, seed=7)
    at = 0
    for n, first in runs:  # one request's rows share its blocks: each row's table a prefix of its last row's
        last = rows[at + n - 1][2]
        for i in range(n):
            rows[at + i] = (1, first + i, last[:-(-(first + i) // bs)])
        at += n
    used = {b for _, _, blocks in rows for b in blocks}
    nan_block = min(set(range(kc.shape[0])) - used)
    kc[nan_block] = vc[nan_block] = float("nan")
    width = max(len(r[2]) for r in rows)
    tables = torch.tensor([r[2] + [nan_block] * (width - len(r[2])) for r in rows], dtype=torch.int32)
    chain = torch.tensor([i for n, _ in runs for i in range(n)], dtype=torch.int32)
    sk = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5][:hq] + [0.0] * max(0, hq - 6)) if sinks else None
    args = (q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV), 1, 0.1, window)
    kw = dict(num_splits=1, sinks=None if sk is None else sk.to(DEV))
    alone = kattn.paged_attention(*args, **kw)
    runs_out = kattn.paged_attention(*args, **kw, chain_pos=chain.to(DEV))
    assert_same_bits(runs_out, alone)
    assert not runs_out.isnan().any()
    ref = reference_attention(q, kc, vc, rows, 0.1, window, sinks=sk)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(runs_out.cpu().float(), ref, **tol)


@pytest.mark.parametrize("splits", [1, 4])
def test_attention_sinks_match_reference(splits):
    """gpt-oss's sinks, with a window, in prefill tiles and in split decode rows (the sink counted once)."""
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 30), (12, 41), (1, 3)], 4, 2, 32, seed=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    ref = reference_attention(q, kc, vc, rows, 0.1, 8, sinks=sinks)
    out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                12, 0.1, 8, sinks=sinks.to(DEV))
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)
    decode = [0, 2]  # the decode rows alone, split over their keys
    q1, t1 = torch.cat((q[:1], q[-1:])), tables[decode]
    ref1 = reference_attention(q1, kc, vc, [rows[i] for i in decode], 0.1, sinks=sinks)
    out1 = kattn.paged_attention(q1.to(DEV), kc.to(DEV), vc.to(DEV), t1.to(DEV), lens[decode].to(DEV),
                                 torch.tensor([0, 1, 2], dtype=torch.int32).to(DEV), 1, 0.1, num_splits=splits,
                                 sinks=sinks.to(DEV))
    torch.testing.assert_close(out1.cpu(), ref1, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,softcap", [(8, None), (None, 20.0), (5, 30.0)])
def test_paged_attention_window_and_softcap(window, softcap):
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 30), (12, 41), (1, 3)], 4, 2, 32, seed=1)
    ref = reference_attention(q, kc, vc, rows, 0.1, window, softcap)
    out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                12, 0.1, window, softcap)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [None, 4])
def test_window_never_reads_blocks_behind_it(splits):
    """A sliding KV group's blocks behind the window are released: their table entries point at a
    block of NaN here, which no tile may load (tiles start TILE_N-aligned, before the window)."""
    rows_spec = [(1, 70), (20, 90), (1, 5), (1, 41)]
    q, kc, vc, rows, tables, lens, qsl = make_step(rows_spec, 4, 2, 32, bs=8, seed=4)
    ref = reference_attention(q, kc, vc, rows, 0.1, 8)
    used = {b for _, _, blocks in rows for b in blocks}
    nan_block = min(set(range(kc.shape[0])) - used)
    kc[nan_block] = vc[nan_block] = float("nan")
    for i, (qlen, ctx) in enumerate(rows_spec):
        first_seen = max(0, ctx - qlen - 8 + 1)  # the row's first query sees from here on
        tables[i, :first_seen // 8] = nan_block
    assert int((tables == nan_block).sum()) > 10
    if splits is None:
        out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                    20, 0.1, 8)
        torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)
    else:  # the decode rows alone, split over their keys
        dec = [0, 2, 3]
        q1 = torch.cat((q[:1], q[-2:]))
        ref1 = reference_attention(q1, kc, vc, [rows[i] for i in dec], 0.1, 8)
        out1 = kattn.paged_attention(q1.to(DEV), kc.to(DEV), vc.to(DEV), tables[dec].to(DEV), lens[dec].to(DEV),
                                     torch.tensor([0, 1, 2, 3], dtype=torch.int32).to(DEV), 1, 0.1, 8,
                                     num_splits=splits)
        torch.testing.assert_close(out1.cpu(), ref1, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(DEV == "cpu", reason="bfloat16 dot products need a GPU (the interpreter runs fp32)")
def test_paged_attention_bf16_close():
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 300), (64, 200), (1, 17)] * 3, 32, 8, 128,
                                                   num_blocks=256, dtype=torch.bfloat16)
    ref = reference_attention(q, kc, vc, rows, 128 ** -0.5)
    out = kattn.paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV),
                                64, 128 ** -0.5)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_attention_on_strided_views():
    """The model passes q and k as views into the fused QKV output."""
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 10), (6, 6)], 4, 2, 32, seed=2)
    t = q.shape[0]
    qkv = torch.randn(t, 4 + 2 * 2, 32)
    qkv[:, :4] = q
    ref = reference_attention(q, kc, vc, rows, 0.2)
    out = kattn.paged_attention(qkv.to(DEV)[:, :4], kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV),
                                qsl.to(DEV), 6, 0.2)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)


def test_write_kv_skips_padding_slots():
    kc = torch.zeros(4, 4, 2, 8, device=DEV)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(3, 6, 8, device=DEV)
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([5, -1, 14], device=DEV)
    kattn.write_kv(kc, vc, k, v, slots)
    flat_k, flat_v = kc.view(16, 2, 8), vc.view(16, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[14], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[14], v[2])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_with_residual(dtype, offset):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    s = x + res
    ref = F.rms_norm(s.float(), (96,), w.float() + offset, 1e-6).to(dtype)
    out, new_res = fused.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset, res.to(DEV))
    if dtype == torch.float32 or DEV == "cuda":
        assert torch.equal(new_res.cpu(), s)
    else:  # the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest
        torch.testing.assert_close(new_res, s, atol=0, rtol=2 ** -7)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)
    alone = fused.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset)
    torch.testing.assert_close(alone.cpu(), F.rms_norm(x.float(), (96,), w.float() + offset, 1e-6).to(dtype),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_in_place(scaling):
    d, max_len = 64, 512
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_frequencies(d, 10000.0, scaling))
    cos, sin = freqs.cos(), freqs.sin()
    x = torch.randn(7, 10, d)
    pos = torch.tensor([0, 3, 4, 100, 200, 511, 7])
    ref = _rotate(x, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    xd = x.to(DEV)
    out = fused.rotary_(xd[:, :6], pos.to(DEV), cos.to(DEV), sin.to(DEV))  # a strided view, like q|k of qkv
    torch.testing.assert_close(out.cpu(), ref[:, :6], atol=1e-5, rtol=1e-5)
    assert torch.equal(xd[:, 6:].cpu(), x[:, 6:])  # the rest (v) untouched


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rotary_with_head_norms(offset):
    """Qwen3's / Gemma 3's q and k RMSNorms in the rotary kernel: each head normalized by the query
    or the key weight, rounded to the activations' dtype, then rotated (as the modules do it)."""
    d, hq, hkv = 64, 6, 2
    g = torch.Generator().manual_seed(3)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_frequencies(d, 10000.0, None))
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.tensor([0, 5, 63])
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(3, hq + 2 * hkv, d, generator=g).to(dtype)
        qw, kw = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
        normed = torch.cat((F.rms_norm(qkv[:, :hq].float(), (d,), qw.float() + offset, 1e-6),
                            F.rms_norm(qkv[:, hq:hq + hkv].float(), (d,), kw.float() + offset, 1e-6)), 1).to(dtype)
        ref = _rotate(normed, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
        xd = qkv.to(DEV)
        out = fused.rotary_(xd[:, :hq + hkv], pos.to(DEV), cos.to(DEV), sin.to(DEV),
                            (qw.to(DEV), kw.to(DEV), hq, 1e-6, offset))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
        assert torch.equal(xd[:, hq + hkv:].cpu(), qkv[:, hq + hkv:])  # v untouched


@pytest.mark.parametrize("hq, hkv, with_norms", [(6, 2, True), (28, 4, False), (32, 8, True)])
def test_rotary_writes_the_cache_as_write_kv_does(hq, hkv, with_norms):
    """The rotary kernel with ``kv``: the queries and keys rotated as without it, and the cache holding what
    rotary_ then write_kv leave there, bit for bit (keys of heads in every head block of the grid; a slot of
    -1, a captured batch's padding row, written nowhere)."""
    d, nb, bs = 64, 6, 16
    g = torch.Generator().manual_seed(hq)
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), inv_frequencies(d, 10000.0, None))
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    pos = torch.tensor([0, 5, 63, 127, 9]).to(DEV)
    slots = torch.tensor([3, 17, 40, -1, 95]).to(DEV)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(5, hq + 2 * hkv, d, generator=g).to(dtype)
        norms = None
        if with_norms:
            norms = (torch.randn(d, generator=g).to(dtype).to(DEV), torch.randn(d, generator=g).to(dtype).to(DEV),
                     hq, 1e-6, 0.0)
        cache = torch.randn(2, nb, bs, hkv, d, generator=g).to(dtype)
        caches = [cache.to(DEV), cache.clone().to(DEV)]
        want, got = qkv.clone().to(DEV), qkv.clone().to(DEV)
        fused.rotary_(want[:, :hq + hkv], pos, cos, sin, norms)
        kattn.write_kv(caches[0][0], caches[0][1], want[:, hq:hq + hkv], want[:, hq + hkv:], slots)
        fused.rotary_(got[:, :hq + hkv], pos, cos, sin, norms, (got[:, hq + hkv:], caches[1][0], caches[1][1], slots))
        assert torch.equal(got.cpu(), want.cpu()), dtype
        assert torch.equal(caches[1].cpu(), caches[0].cpu()), dtype


def _clamped_swiglu(gate, up, alpha=1.702, limit=0.3):  # transformers' GptOssExperts, as gpt_oss.py has it
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("act,ref", [
    (fused.SILU, lambda g, u: F.silu(g) * u),
    (fused.GELU_TANH, lambda g, u: F.gelu(g, approximate="tanh") * u),
    (fused.GELU, lambda g, u: F.gelu(g) * u),
    (fused.CLAMPED_SWIGLU, _clamped_swiglu),
])
def test_gated_activation(act, ref):
    x = torch.randn(4, 2 * 1500)
    out = fused.gated_act(x.to(DEV), act, 1.702, 0.3)
    torch.testing.assert_close(out.cpu(), ref(*x.chunk(2, -1)), atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(out.abs().max()))
    bias, ids = torch.randn(3, 2 * 1500), torch.tensor([2, 0, 2, 1])  # rows' experts' biases
    out = fused.gated_act(x.to(DEV), act, 1.702, 0.3, bias.to(DEV), ids.to(DEV))
    torch.testing.assert_close(out.cpu(), ref(*(x + bias[ids]).chunk(2, -1)), atol=1e-5, rtol=1e-5)


def test_producers_write_the_8_bit_form_the_gemv_would():
    """RMSNorm and the gated activation write their output's 8-bit form beside it (up to
    ``int8_rows`` rows of 16-bit activations in whole blocks of 32): bit for bit what quantizing the
    output gives, attached to it while nothing changes it; none past the limit or for float32."""
    from pocketllm.kernels.triton.int8_act import attached, quantize_activations

    def same_as_quantized(out):
        got, want = attached(out), quantize_activations(out.reshape(-1, out.shape[-1]))
        assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want))

    g = torch.Generator().manual_seed(5)
    x, res, w = (torch.randn(3, 96, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    out, _ = fused.rms_norm(x, w[0], 1e-6, 0.0, res, int8_rows=3)
    same_as_quantized(out)
    assert attached(fused.rms_norm(x, w[0], 1e-6, 0.0, res, int8_rows=2)[0]) is None
    assert attached(fused.rms_norm(x.float(), w[0].float(), 1e-6, int8_rows=3)) is None
    # three blocks of 1024 columns, the last one short; and one block wider than a row (768 = 24 x 32)
    for n, act in ((2080, fused.SILU), (768, fused.CLAMPED_SWIGLU)):
        gate_up = torch.randn(4, 2 * n, generator=g).to(DEV, torch.bfloat16)
        same_as_quantized(fused.gated_act(gate_up, act, 1.702, 7.0, int8_rows=4))
        assert attached(fused.gated_act(gate_up, act, 1.702, 7.0)) is None


def test_split_merge_writes_the_8_bit_form(monkeypatch):
    """Decode rows merged from key splits: each head's groups of the output's 8-bit form, carried
    to the [T, H * D] view the output projection reads. (float32 here, as the interpreter's
    attention runs; ``wanted`` takes 16-bit activations only.)"""
    from pocketllm.kernels.triton import int8_act

    monkeypatch.setattr(int8_act, "wanted", lambda y, rows: y.shape[0] <= rows)
    q, kc, vc, rows, tables, lens, qsl = make_step([(1, 17), (1, 70)], 8, 2, 64, seed=4)
    args = (q.to(DEV), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), qsl.to(DEV), 1, 0.125)
    out = kattn.paged_attention(*args, num_splits=4, int8_rows=2)
    with torch.inference_mode():  # as the engine runs: views there do not know their base
        flat = int8_act.flattened(out)
        assert int8_act.attached(flat) is not None and int8_act.attached(out.reshape(2, -1)) is None
    got, want = int8_act.attached(flat), int8_act.quantize_activations(flat)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    assert int8_act.attached(int8_act.flattened(out[:, :4])) is None  # a copy of part of it: not the form
    merged_in_place = kattn.paged_attention(*args, num_splits=4, int8_rows=1)  # no 8-bit form: the last split merges
    assert int8_act.attached(int8_act.flattened(merged_in_place)) is None
    assert torch.equal(merged_in_place, out)  # either way a row's bits are the same


@pytest.mark.parametrize("experts,k,renormalize,softmax_of_top_k", [
    (128, 8, True, False),  # Qwen3-MoE
    (8, 2, True, False),  # Mixtral
    (7, 3, False, False),
    (32, 4, False, True),  # gpt-oss
])
def test_top_k_route_is_torchs_routing(experts, k, renormalize, softmax_of_top_k):
    """The one-launch router: the experts torch.topk picks, largest first, and the weights of
    SparseMoE.route's torch ops (softmax then top k, renormalized or not; or top k then softmax),
    from float32 and bfloat16 logits, with and without a router bias (gpt-oss's, added in float32)."""
    from pocketllm.kernels.triton.moe import top_k_route

    g = torch.Generator().manual_seed(experts + k)
    biases = (None, None, torch.randn(experts, generator=g), torch.randn(experts, generator=g).to(torch.bfloat16))
    for dtype, bias in zip((torch.float32, torch.bfloat16) * 2, biases):
        logits = torch.randn(9, experts, generator=g).to(dtype)
        full = logits.float() if bias is None else logits.float() + bias.float()
        if softmax_of_top_k:
            top, ref_ids = torch.topk(full, k, dim=-1)
            ref_w = torch.softmax(top, dim=-1)
        else:
            ref_w, ref_ids = torch.topk(torch.softmax(full, dim=-1), k, dim=-1)
            if renormalize:
                ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        w, ids = top_k_route(logits.to(DEV), k, renormalize, softmax_of_top_k, None if bias is None else bias.to(DEV))
        assert ids.dtype == torch.int64
        # equal logits (bfloat16 has ties) may come in another order than torch's: compare by expert
        ids, order = ids.cpu().sort(-1)
        ref_ids, ref_order = ref_ids.sort(-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w.cpu().gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=1e-5)
        assert bool((w[:, :-1] >= w[:, 1:]).all())  # largest first
    logits[0], logits[1, :2] = float("nan"), float("nan")  # broken rows: still k experts in range
    ids = top_k_route(logits.to(DEV), k, renormalize, softmax_of_top_k)[1].cpu()
    assert bool(((ids >= 0) & (ids < experts)).all())


def test_weighted_sum_of_expert_outputs():
    from pocketllm.kernels.triton.moe import weighted_sum

    g = torch.Generator().manual_seed(4)
    y, w = torch.randn(5 * 3, 1100, generator=g), torch.rand(5, 3, generator=g)
    ref = torch.einsum("tkh,tk->th", y.view(5, 3, -1), w)
    torch.testing.assert_close(weighted_sum(y.to(DEV), w.to(DEV)).cpu(), ref, atol=1e-5, rtol=1e-5)
    bias, ids = torch.randn(4, 1100, generator=g), torch.tensor([3, 0, 1, 1, 2, 0, 3, 3, 3, 0, 1, 2, 2, 2, 0])
    ref = torch.einsum("tkh,tk->th", (y + bias[ids]).view(5, 3, -1), w)
    torch.testing.assert_close(weighted_sum(y.to(DEV), w.to(DEV), bias.to(DEV), ids.to(DEV)).cpu(), ref,
                               atol=1e-5, rtol=1e-5)
    yb = y.bfloat16()
    out = weighted_sum(yb.to(DEV), w.to(DEV))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), torch.einsum("tkh,tk->th", yb.float().view(5, 3, -1), w),
                               atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["gemma3", "llama", "qwen2", "qwen3"])
def test_engine_on_kernel_attention_matches_transformers(kind, tiny_models):
    """The runner's kernel metadata (flat block tables, query_start_loc, seq_lens) through the
    attention kernel, with chunked prefill over cached prefixes: greedy tokens equal transformers'.
    The mixtures of experts attend as llama and qwen3 do; gpt-oss's sinks take this path in
    test_sliding_window_kv's kernel test."""
    from conftest import prompts_of
    from reference import hf_greedy

    from pocketllm import LLM, SamplingParams

    model, path = tiny_models[kind]
    prompts = prompts_of([1, 17, 33])
    llm = LLM(str(path), device=DEV, dtype="float32", max_num_batched_tokens=24)
    llm.engine.runner.use_kernels = True  # what CUDA uses; on the CPU the kernel runs interpreted
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 6) for p in prompts]
    llm.engine.check_no_leaks()


def test_speculative_rows_on_kernel_attention_read_keys_in_runs(tiny_models, monkeypatch):
    """Drafts verified on the kernel path with unsplit decode rows (as at 64 sequences on a GPU): the
    runner marks each request's rows (``chain_pos``), the kernel takes them in runs, and greedy tokens
    still equal transformers'."""
    from conftest import prompts_of
    from reference import hf_greedy

    from pocketllm import LLM, SamplingParams

    model, path = tiny_models["llama"]
    prompts = [p * 3 for p in prompts_of([4, 7])]  # repeated: n-gram lookup finds drafts
    monkeypatch.setattr(kattn, "decode_splits", lambda *a: 1)
    seen, real = [], kattn.paged_attention
    monkeypatch.setattr(kattn, "paged_attention", lambda *a, **kw: seen.append(kw.get("chain_pos")) or real(*a, **kw))
    llm = LLM(str(path), device=DEV, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    llm.engine.runner.use_kernels = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert any(c is not None and int(c.max()) > 0 for c in seen)  # runs of a request's rows
    llm.engine.check_no_leaks()


def test_invariant_linear_gives_a_row_the_same_bits_at_any_row_count():
    """The row-invariant GEMM: x . w^T + bias to float32 rounding (K split in two, N and K not multiples of
    its tiles), and each row's bits the same computed among 1, 3, 49 or 130 rows."""
    from pocketllm.kernels.triton.invariant_gemm import SPLIT_K, invariant_linear

    g = torch.Generator().manual_seed(11)
    k, n = SPLIT_K + 160, 100
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        x = torch.randn(130, k, generator=g).to(dtype)
        ref = x.double() @ w.double().T + b.double()
        y = invariant_linear(x.to(DEV), w.to(DEV), b.to(DEV)).cpu()
        assert y.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        assert float((y.double() - ref).abs().max()) <= tol * float(ref.abs().max())
        for m in (1, 3, 49):
            assert_same_bits(invariant_linear(x[-m:].to(DEV), w.to(DEV), b.to(DEV)).cpu(), y[-m:], (dtype, m))


def test_speculative_decoding_marks_the_row_parallel_projections(tiny_models):
    """use_row_invariant_gemms: o and down of every layer (the row-parallel dense projections), nothing else."""
    from pocketllm import LLM
    from pocketllm.layers.linear import Linear, use_row_invariant_gemms

    model = LLM(str(tiny_models["llama"][1]), max_model_len=64, num_kv_blocks=16).engine.runner.model
    assert not any(isinstance(m, Linear) and m.invariant_rows is not None for m in model.modules())  # opt-in
    assert use_row_invariant_gemms(model) == 2 * model.cfg.num_layers
    marked = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
              if isinstance(m, Linear) and m.invariant_rows is not None}
    assert marked == {"o_proj", "down_proj"}


def test_split_sums_are_added_in_order_cast_and_biased():
    """A K-split product's partial sums: split 0 + split 1 + ... in float32, in that order, then the bias,
    then the cast (the bits of the same torch ops), for one split and several, bf16 and float32 out."""
    from pocketllm.kernels.triton.split_sum import sum_splits

    g = torch.Generator().manual_seed(11)
    for s, m, n in ((1, 3, 70), (3, 5, 1100), (4, 1, 33)):
        part = torch.randn(s, m, n, generator=g) * torch.logspace(-3, 3, n)  # sums whose order shows in the bits
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        want = part[0].clone()
        for i in range(1, s):
            want += part[i]
        for dtype, b in ((torch.bfloat16, None), (torch.float32, bias), (torch.bfloat16, bias)):
            ref = want if b is None else want + b.float()
            if dtype == torch.bfloat16 and DEV == "cpu":  # the interpreter truncates float32 -> bfloat16
                ref = (ref.view(torch.int32) & -65536).view(torch.float32)
            got = sum_splits(part.to(DEV), dtype, None if b is None else b.to(DEV)).cpu()
            assert got.dtype == dtype and torch.equal(got, ref.to(dtype)), (s, m, n, dtype)
