"""The CPU fast path's layer kernels (RMSNorm with the residual add, rotary embedding, the KV-cache
write and decode attention) against the torch ops the exact path runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pocketllm.kernels.cpu import layer_ops
from pocketllm.kernels.cpu.build import compiler
from pocketllm.layers.attention import AttentionMetadata, PrefillSpan, paged_attention
from pocketllm.layers.rotary import RotaryEmbedding, _rotate

if compiler() is None:  # with one, the kernels must build: a build that fails fails these tests
    pytest.skip("no C compiler: the CPU kernels are not built", allow_module_level=True)

gen = torch.Generator().manual_seed(0)


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_the_residual_add(rows):
    x, res, w = randn(rows, 576), randn(rows, 576), randn(576)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    want_res = x + res
    y, new_res = layer_ops.rms_norm(x, w, 1e-6, res)
    assert new_res is res  # updated in place: the residual stream
    torch.testing.assert_close(new_res, want_res)
    torch.testing.assert_close(y, F.rms_norm(want_res, (576,), w, 1e-6))


def test_rotary_in_place_on_a_strided_view():
    rot = RotaryEmbedding(64, 512, 10000.0)
    qkv = randn(5, 12 + 2 * 4, 64)  # queries and keys rotate, values stay
    qk = qkv[:, :16]
    pos = torch.tensor([0, 3, 100, 511, 7])
    want = _rotate(qk, rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1))
    values = qkv[:, 16:].clone()
    assert layer_ops.rotary_(qk, pos, rot.cos, rot.sin) is qk
    torch.testing.assert_close(qkv[:, :16], want)
    assert torch.equal(qkv[:, 16:], values)


def step_metadata(decode_lens: list[int], prefills: list[tuple[int, int]], bs: int, num_blocks: int):
    """A step's torch-path metadata (as the runner builds it) over randomly placed blocks: decode rows
    of the given context lengths, then prefill chunks of (query length, context length)."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for ctx, ql in [(c, 1) for c in decode_lens] + [(c, q) for q, c in prefills]:
        blocks = [free.pop() for _ in range(-(-ctx // bs))]
        tables.append(blocks)
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx - ql, ctx)]
    n = len(decode_lens)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=n)
    if n:
        width = max(len(t) for t in tables[:n])
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:n]])
        meta.decode_lens = torch.tensor(decode_lens)
        meta.decode_mask = (torch.arange(width * bs)[None, :] < meta.decode_lens[:, None])[:, None, None, :]
    q0 = n
    for (ql, ctx), blocks in zip(prefills, tables[n:]):
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - ql, ctx)[:, None]
        meta.prefills.append(PrefillSpan(q0, ql, ctx, torch.tensor(blocks), mask))
        q0 += ql
    return meta, q0


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False), (None, 30.0, False),
                                                  (None, None, True), (5, None, True)])
@pytest.mark.parametrize("decodes,prefills", [([1], []), ([17, 3, 40, 16], []), ([9, 33], [(6, 20), (1, 1)]),
                                              ([], [(12, 12)])])
def test_cache_write_and_decode_attention_match_the_torch_path(decodes, prefills, window, softcap, sinks):
    bs, nb, hq, hkv, d = 16, 24, 6, 2, 32
    meta, t = step_metadata(decodes, prefills, bs, nb)
    caches = randn(2, nb, bs, hkv, d)
    q, k, v = randn(t, hq, d), randn(t, hkv, d), randn(t, hkv, d)
    sink = randn(hq) * 2 if sinks else None  # gpt-oss: a logit per head in each softmax
    outs = []
    for cpu_fused in (False, True):
        kc, vc = caches[0].clone(), caches[1].clone()
        o = paged_attention(q, k, v, kc, vc, meta, 0.3, window, softcap, cpu_fused=cpu_fused, sinks=sink)
        outs.append((o, kc, vc))
    (want, kc0, vc0), (got, kc1, vc1) = outs
    assert torch.equal(kc0, kc1) and torch.equal(vc0, vc1)  # the same slots written, bit for bit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 64), (8, 2, 64), (16, 2, 64), (8, 4, 128), (12, 2, 128),
                                      (4, 1, 128), (8, 2, 256), (16, 1, 576), (3, 1, 96)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (70, 30.0, True)])
def test_decode_attention_of_common_head_shapes(hq, hkv, d, window, softcap, sinks):
    """Head dims 64 and 128 take vectorized kernels (AVX-512) with the query heads of a key head in
    registers, in groups of up to 4 (64) or 2 (128), and wider multiples of 64 (DeepSeek's latent 576) those
    piece by piece; other widths (96) the plain loops: every group size against the torch path, positions
    not a multiple of 4 included."""
    bs, nb = 16, 64
    meta, t = step_metadata([1, 3, 67, 130, 301], [], bs, nb)
    caches = randn(2, nb, bs, hkv, d)
    q, k, v = randn(t, hq, d), randn(t, hkv, d), randn(t, hkv, d)
    sink = randn(hq) * 2 if sinks else None
    outs = [paged_attention(q, k, v, caches[0].clone(), caches[1].clone(), meta, d ** -0.5, window, softcap,
                            cpu_fused=cpu_fused, sinks=sink) for cpu_fused in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_decode_attention_is_batch_invariant():
    """A query's output is the same bits alone and among others (its context's split into chunks
    follows its own length): what lets speculative rows reproduce plain decoding exactly."""
    bs, nb, hq, hkv, d = 16, 64, 9, 3, 64
    meta, t = step_metadata([300, 5, 140, 77], [], bs, nb)
    caches = randn(2, nb, bs, hkv, d)
    q = randn(t, hq, d)
    kc, vc = caches[0], caches[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # a query alone then has threads to split its context over
    try:
        together = layer_ops.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_lens, 0.125, None,
                                              None)
        for i in range(t):
            alone = layer_ops.decode_attention(q[i:i + 1], kc, vc, meta.decode_block_tables[i:i + 1].contiguous(),
                                               meta.decode_lens[i:i + 1].contiguous(), 0.125, None, None)
            assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (200, None, False), (None, 30.0, False),
                                                  (None, None, True)])
@pytest.mark.parametrize("decodes", [[300], [1, 290], [64, 64, 64]])
def test_long_contexts_split_among_threads(decodes, window, softcap, sinks):
    """Each query's context is split in chunks (at least 64 positions each) whose partial softmax
    results are merged, a sink with them; 4 threads share the chunks."""
    bs, nb, hq, hkv, d = 16, 48, 6, 2, 32
    meta, t = step_metadata(decodes, [], bs, nb)
    caches = randn(2, nb, bs, hkv, d)
    q, k, v = randn(t, hq, d), randn(t, hkv, d), randn(t, hkv, d)
    sink = randn(hq) * 2 if sinks else None
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        outs = [paged_attention(q, k, v, caches[0].clone(), caches[1].clone(), meta, 0.3, window, softcap,
                                cpu_fused=cpu_fused, sinks=sink) for cpu_fused in (False, True)]
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (7, 20.0, False), (7, None, True)])
def test_fused_decode_step_rotates_writes_and_attends(window, softcap, sinks):
    bs, nb, hq, hkv, d = 16, 24, 6, 2, 32
    decodes = [1, 17, 40]
    meta, t = step_metadata(decodes, [], bs, nb)
    rot = RotaryEmbedding(d, 64, 10000.0)
    pos = torch.tensor(decodes) - 1
    qkv = randn(t, hq + 2 * hkv, d)
    caches = randn(2, nb, bs, hkv, d)
    kc, vc = caches[0].clone(), caches[1].clone()
    qk = rot(pos, qkv[:, :hq + hkv])  # the torch path: rotate, then write and attend
    sink = randn(hq) * 2 if sinks else None
    want = paged_attention(qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:], kc, vc, meta, 0.3, window, softcap, sinks=sink)
    fused = qkv.clone()
    fkc, fvc = caches[0].clone(), caches[1].clone()
    got = layer_ops.fused_decode_attention(fused, hq, fkc, fvc, meta.slot_mapping, meta.decode_block_tables,
                                           meta.decode_lens, 0.3, window, softcap, (pos, rot.cos, rot.sin), sink)
    torch.testing.assert_close(fused[:, :hq + hkv], qk)  # rotated in place
    torch.testing.assert_close(fkc, kc)
    assert torch.equal(fvc, vc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act,ref", [(0, F.silu), (1, lambda g: F.gelu(g, approximate="tanh"))])
def test_gated_activations(act, ref):
    gate_up = randn(3, 2 * 700) * 4
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.5, 89.0, 1e-8])
    gate, up = gate_up.chunk(2, dim=-1)
    # within a few float32 ulp of torch's (which rounds a tail like -20's to 0 exactly)
    torch.testing.assert_close(layer_ops.gated_act(gate_up, act), ref(gate) * up, rtol=4e-6, atol=2e-6)


def test_clamped_swiglu():
    """gpt-oss's expert activation, against transformers' formula in torch (within a few ulp)."""
    gate_up = randn(3, 2 * 700) * 4
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, 7.0])  # below, far above and at the limit
    gate_up[0, 700:704] = torch.tensor([-100.0, 100.0, -7.0, 0.5])
    gate, up = gate_up.chunk(2, dim=-1)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    want = (u + 1) * (g * torch.sigmoid(g * 1.702))
    torch.testing.assert_close(layer_ops.clamped_swiglu(gate_up, 1.702, 7.0), want, rtol=4e-6, atol=2e-6)
