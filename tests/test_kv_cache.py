"""Block pool, prefix cache and scheduler invariants on exact block ids (no model needed)."""
from __future__ import annotations

from pocketllm.core.kv_layout import NO_BLOCK, KVLayout
from pocketllm.core.request import Request, RequestStatus
from pocketllm.engine.block_pool import BlockPool
from pocketllm.engine.kv_cache_manager import KVCacheManager, hash_block
from pocketllm.engine.scheduler import Scheduler, SchedulerConfig
from pocketllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=8):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def make(num_blocks=10, windows=(None,), **kw):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, hash_salt=b"test", windows=windows)
    cfg = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 8),
                          max_num_batched_tokens=kw.pop("budget", 64), max_model_len=64, **kw)
    return Scheduler(cfg, kv), kv


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    return out


def test_free_queue_is_lru_and_removal_is_from_the_middle():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.free([a[2], a[0]])  # freed in this order -> evicted in this order after the never-used ones
    assert pool.free_queue.block_ids() == [3, 4, 2, 0]
    pool.touch([a[2]])  # a prefix hit takes block 2 back from the middle
    assert pool.free_queue.block_ids() == [3, 4, 0]
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 0]
    pool.check_integrity()


def test_chained_hashes_depend_on_the_whole_prefix():
    root = b"r"
    h1 = hash_block(root, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(root, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(root, [1, 2, 3, 4]) == h1 and len(h1) == 32


def test_prefix_hit_reuses_exact_blocks_and_recomputes_the_last_token():
    sched, kv = make()
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    sched.add_request(a)
    run_step(sched)
    assert a.block_ids == [0, 1, 2]
    # Same 8-token prefix: the two full blocks are shared, not copied.
    b = req("b", list(range(8)) + [99, 98, 97])
    sched.add_request(b)
    run_step(sched)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == [0, 1]
    assert kv.pool.blocks[0].ref_cnt == 2
    # A prompt that is exactly the cached blocks still computes its last token.
    c = req("c", list(range(8)))
    sched.add_request(c)
    out = run_step(sched)
    assert c.num_cached_tokens == 4
    assert [s.num_tokens for s in out.scheduled if s.request is c] == [4]


def test_freed_blocks_keep_their_hash_until_evicted_in_lru_order():
    sched, kv = make(num_blocks=6)
    a = req("a", list(range(8)), max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    assert a.is_finished and a.block_ids == []
    # Freed tail first: block 1 (tail of the chain) is ahead of block 0 in eviction order.
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert len(kv.pool.cached) == 2
    b = req("b", list(range(8)) + [50])
    sched.add_request(b)
    run_step(sched)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == [0, 1]
    # New blocks come from the head of the free list: never-used block 2 first.
    assert b.block_ids[2] == 2
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    # Filling the cache evicts the least recently freed blocks first.
    d = req("d", list(range(100, 120)))  # 5 blocks
    sched.add_request(d)
    run_step(sched)
    assert d.block_ids == [3, 4, 5, 2, 1]
    assert {h for _, h in kv.pool.cached} == {kv.pool.blocks[0].block_hash} | {
        kv.pool.blocks[i].block_hash for i in d.block_ids[:5]}
    sched.finish_request("d", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 6
    kv.pool.check_integrity()


def test_mixed_batch_decodes_first_then_chunks_within_budget():
    sched, kv = make(num_blocks=40, budget=10)
    a = req("a", list(range(6)))
    sched.add_request(a)
    run_step(sched)  # a prefilled, now decoding
    b = req("b", list(range(50, 75)))  # 25 tokens: chunked over 3 steps
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_decodes == 1 and out.total_tokens == 10
    sched.update_from_output(out, {"a": [1]})
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert b.num_output_tokens == 1


def test_preemption_takes_the_newest_and_the_oldest_always_finishes():
    sched, kv = make(num_blocks=6)
    reqs = [req(str(i), list(range(i * 10, i * 10 + 6)), max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    preempted = []
    while sched.has_work():
        newest = sched.running[-1].request_id if sched.running else None
        out = run_step(sched)
        if out.preempted:
            assert out.preempted[0].request_id == newest
        preempted += [r.request_id for r in out.preempted]
        steps += 1
        assert steps < 200, "no progress: deadlock"
        kv.pool.check_integrity()
    assert preempted and "0" not in preempted  # the oldest request is never the victim
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert kv.num_free_blocks == 6


def test_abort_frees_blocks_immediately():
    sched, kv = make()
    a = req("a", list(range(9)))
    sched.add_request(a)
    run_step(sched)
    assert kv.num_free_blocks == 7
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 10 and not sched.running


# -- KV groups: a full-attention group and sliding-window groups on one pool -----------------------

def test_layer_groups_split_unequal_kinds_into_equal_groups():
    # Gemma 3 27B: a global layer every sixth of 62 -> 10 global, 52 sliding: groups of 10 layers
    layout = KVLayout.of([None if (i + 1) % 6 == 0 else 1024 for i in range(62)])
    assert layout.layers_per_block == 10
    assert layout.windows == (None,) + (1024,) * 6
    assert [len(g.layers) for g in layout.groups] == [10, 9, 9, 9, 9, 8, 8]
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(62))
    # every layer has one place: (group, KV tensor), tensors < layers_per_block
    place = layout.placement()
    assert len(set(place)) == 62 and max(t for _, t in place) == 9
    # gpt-oss: 12 sliding + 12 full -> two groups of 12; counts within 25% pad to the larger
    assert KVLayout.of([128, None] * 12).layers_per_block == 12
    assert KVLayout.of([128] * 12 + [None] * 13).layers_per_block == 13
    # no sliding layers: one group of every layer, as before
    plain = KVLayout.of([None] * 5)
    assert not plain.is_hybrid and plain.layers_per_block == 5 and plain.groups[0].layers == (0, 1, 2, 3, 4)
    assert plain.blocks_for(33, 16, 2048) == 3 and plain.max_tokens(10, 16, 2048) == 160


def test_a_request_holds_its_window_and_the_full_sequence_on_exact_blocks():
    """Window 8, blocks of 4: a query at position p sees p - 7 .. p, so the sliding group keeps at
    most ceil(7 / 4) + 1 = 3 blocks (plus a chunk's), and releases the rest to the pool as the
    window moves, at the next allocation."""
    sched, kv = make(num_blocks=20, windows=(None, 8), budget=8)
    a = req("a", list(range(20)), max_tokens=3)
    sched.add_request(a)
    run_step(sched)  # tokens 0..7
    assert a.block_tables == [[0, 1], [2, 3]]
    run_step(sched)  # 8..15: the query at 8 still sees position 1
    assert a.block_tables == [[0, 1, 4, 5], [2, 3, 6, 7]]
    run_step(sched)  # 16..19: the query at 16 sees 9.. -> logical blocks 0 and 1 released
    assert a.block_tables == [[0, 1, 4, 5, 8], [NO_BLOCK, NO_BLOCK, 6, 7, 9]]
    assert kv.pool.free_queue.block_ids()[-2:] == [2, 3]  # released blocks join the LRU tail
    run_step(sched)  # decode at 20: sees 13.. -> logical block 2 released
    assert a.block_tables == [[0, 1, 4, 5, 8, 10], [NO_BLOCK] * 3 + [7, 9, 11]]
    assert kv.num_held_blocks(a) == 9 and kv.num_free_blocks == 20 - 9
    # the released blocks were registered first: they stay findable by their hash
    assert all(kv.pool.lookup(a.block_hashes[i], 1) is kv.pool.blocks[b] for i, b in enumerate([2, 3, 6]))
    run_step(sched)
    assert a.is_finished and a.block_tables == [] and kv.num_free_blocks == 20
    kv.pool.check_integrity()


def test_hybrid_prefix_hit_adopts_the_full_chain_and_the_window_before_it():
    sched, kv = make(num_blocks=20, windows=(None, 8), budget=8)
    a = req("a", list(range(20)), max_tokens=3)
    sched.add_request(a)
    while sched.has_work():
        run_step(sched)
    b = req("b", list(range(20)), max_tokens=1)
    sched.add_request(b)
    out = run_step(sched)
    # 4 full blocks hit (the 20th token is recomputed); the query at 16 sees 9..16: the sliding
    # group adopts logical blocks 2 and 3 (released by `a` as its window moved) and nothing before
    assert b.num_cached_tokens == 16 and [s.num_tokens for s in out.scheduled] == [4]
    assert kv.num_hit_tokens == 16
    b2 = req("b2", list(range(20)), max_tokens=1)
    sched.add_request(b2)
    sched.schedule()
    assert b2.block_tables[0][:4] == [0, 1, 4, 5] and b2.block_tables[1][:4] == [NO_BLOCK, NO_BLOCK, 6, 7]
    assert kv.pool.blocks[6].ref_cnt == 1 and kv.pool.blocks[2].ref_cnt == 0  # only the window is held
    sched.finish_request("b2", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 20
    # Without logical block 3 in the sliding group, a hit must end where its window is cached:
    # blocks 1 and 2 are -> 3 blocks (12 tokens), the full group's chain cut to match.
    kv.pool.unregister(kv.pool.blocks[7])
    c = req("c", list(range(20)), max_tokens=1)
    sched.add_request(c)
    sched.schedule()
    assert c.num_cached_tokens == 12
    assert c.block_tables[0][:3] == [0, 1, 4] and c.block_tables[1][:3] == [NO_BLOCK, 3, 6]
    sched.finish_request("c", RequestStatus.FINISHED_ABORTED)
    # A window reaching back to the first block: a hit needs every block from there.
    sched2, kv2 = make(num_blocks=20, windows=(16,))
    d = req("d", list(range(9)), max_tokens=1)
    sched2.add_request(d)
    run_step(sched2)
    e = req("e", list(range(9)), max_tokens=1)
    sched2.add_request(e)
    sched2.schedule()
    assert e.num_cached_tokens == 8 and e.block_tables[0][:2] == [0, 1] and len(e.block_tables[0]) == 2 + 1
    assert e.block_tables[0][2] not in (0, 1)  # its own block for the uncached token
    kv.pool.check_integrity()
    kv2.pool.check_integrity()


def test_hybrid_preemption_and_cancellation_mid_prefill_free_every_group():
    sched, kv = make(num_blocks=24, windows=(None, 8, 8), budget=8)
    a = req("a", list(range(40)), max_tokens=4)
    sched.add_request(a)
    for _ in range(3):  # 24 of 40 prompt tokens: sliding blocks already released
        run_step(sched)
    assert not a.prefill_done and a.block_tables[1][0] == NO_BLOCK
    held = kv.num_held_blocks(a)
    assert kv.num_free_blocks == 24 - held
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 24 and a.block_tables == []
    # Preemption: a newer request mid-prefill is the victim when the older one needs blocks.
    old, new = req("old", list(range(100, 112)), max_tokens=30), req("new", list(range(200, 240)), max_tokens=2)
    sched.add_request(old)
    run_step(sched)
    run_step(sched)
    sched.add_request(new)
    preempted = []
    for _ in range(200):
        if not sched.has_work():
            break
        out = run_step(sched)
        for victim in out.preempted:
            assert victim.block_tables == [] and not victim.prefill_done
            preempted.append(victim.request_id)
        kv.pool.check_integrity()
        assert kv.num_free_blocks + sum(kv.num_held_blocks(r) for r in sched.running) == 24
    assert preempted and set(preempted) == {"new"}
    assert old.num_output_tokens == 30 and new.num_output_tokens == 2
    assert kv.num_free_blocks == 24


def test_failed_step_forgets_released_blocks_nobody_holds():
    sched, kv = make(num_blocks=20, windows=(None, 8), budget=8)
    a = req("a", list(range(20)), max_tokens=8)
    sched.add_request(a)
    for _ in range(4):
        run_step(sched)
    released = [kv.pool.blocks[i] for i in (2, 3)]  # sliding logical blocks 0 and 1, released, hashed
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in released)
    kv.forget_exclusive_blocks(a)
    assert all(b.block_hash is None for b in released)
    assert all(kv.pool.blocks[i].block_hash is None for i in a.block_tables[0][:a.num_hashed_blocks])


def test_a_step_that_decodes_takes_few_prompt_tokens():
    """`max_prefill_tokens_with_decodes`: while a stream decodes, a long prompt comes in chunks of the cap
    (so that the stream's next token waits for a short step); a step with nothing to decode takes the
    whole budget, and prompts without a decoding stream beside them (a prompt of one token) do not
    count as one."""
    sched, _ = make(num_blocks=64, budget=48, max_prefill_tokens_with_decodes=8)
    a = req("a", [1])
    sched.add_request(a)
    assert [s.num_tokens for s in run_step(sched).scheduled] == [1]
    long = req("long", list(range(100, 140)))
    sched.add_request(long)
    steps = [[(s.request.request_id, s.num_tokens) for s in run_step(sched).scheduled] for _ in range(3)]
    assert steps == [[("a", 1), ("long", 8)], [("a", 1), ("long", 8)], [("a", 1), ("long", 8)]]
    sched, _ = make(num_blocks=64, budget=48, max_prefill_tokens_with_decodes=8)
    sched.add_request(req("one", [1]))
    sched.add_request(req("long", list(range(100, 140))))
    assert [s.num_tokens for s in run_step(sched).scheduled] == [1, 40]  # nobody decodes yet
    # without chunked prefill the cap does not apply: a prompt must go in whole
    sched, _ = make(num_blocks=64, budget=48, max_prefill_tokens_with_decodes=8, enable_chunked_prefill=False)
    sched.add_request(req("a", [1]))
    run_step(sched)
    sched.add_request(req("long", list(range(100, 140))))
    assert [s.num_tokens for s in run_step(sched).scheduled] == [1, 40]
