"""Block pool, prefix cache and scheduler invariants on exact block ids (no model needed)."""
from __future__ import annotations

from pocketllm.engine.block_pool import BlockPool
from pocketllm.engine.kv_cache_manager import KVCacheManager, hash_block
from pocketllm.engine.request import Request, RequestStatus
from pocketllm.engine.scheduler import Scheduler, SchedulerConfig
from pocketllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=8):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def make(num_blocks=10, **kw):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, hash_salt=b"test")
    cfg = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 8),
                          max_num_batched_tokens=kw.pop("budget", 64), max_model_len=64, **kw)
    return Scheduler(cfg, kv), kv


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
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
    assert set(kv.pool.cached) == {kv.pool.blocks[0].block_hash} | {
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
    sched.update_from_output(out, {"a": 1})
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
