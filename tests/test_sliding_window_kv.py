"""Sliding-window layers keep only their window: the hybrid KV layout (a full-attention group and
sliding groups on one block pool) against transformers, on prompts several windows long (the tiny
Gemma 3 and gpt-oss have windows of 8 tokens), and the blocks it holds counted exactly."""
from __future__ import annotations

import pytest
from conftest import prompts_of
from reference import captured_logits, hf_greedy, hf_last_logits

from pocketllm import LLM, SamplingParams
from pocketllm.core.kv_layout import NO_BLOCK
from pocketllm.errors import ConfigurationError

HYBRID = ["gemma3", "gpt_oss"]
BS = 8
WINDOW = 8  # both tiny configs
LONG = [3, 24, 57, 100, 150]  # up to ~19 windows
NEW = 32


@pytest.fixture(params=HYBRID)
def hybrid(request, tiny_models):
    return request.param, *tiny_models[request.param]


@pytest.fixture
def expected(hybrid):
    _, model, _ = hybrid
    prompts = prompts_of(LONG, seed=5)
    return prompts, [hf_greedy(model, p, NEW) for p in prompts]


def make(path, **kw):
    kw = {"dtype": "float32", "exact_kernels": True, "block_size": BS, **kw}
    return LLM(str(path), **kw)


def greedy(llm, prompts, new=NEW):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], outs


def sliding_groups(llm) -> int:
    return sum(1 for w in llm.engine.kv_layout.windows if w is not None)


def test_layout_and_capabilities(hybrid):
    kind, _, path = hybrid
    llm = make(path)
    layout = llm.engine.kv_layout
    assert llm.engine.runtime.capabilities.sliding_window_kv == "window"
    assert layout.is_hybrid and layout.windows[0] is None and set(layout.windows[1:]) == {WINDOW}
    assert layout.layers_per_block == 1  # 1 global layer: groups of one layer
    # layers of different groups share KV tensors; each reads its group's table
    runner = llm.engine.runner
    assert len(runner.k_caches) == 1
    attns = [layer.self_attn for layer in runner.model.model.layers]
    assert all(a.k_cache is runner.k_caches[0] for a in attns)
    assert sorted(a.kv_group for a in attns) == list(range(len(layout.groups)))
    assert all((a.window is None) == (a.kv_group == 0) for a in attns)


def test_the_dispatcher_checks_the_declared_kv_layout(hybrid, monkeypatch):
    from dataclasses import replace

    from pocketllm.errors import UnsupportedFeatureError

    _, _, path = hybrid
    cls = type(make(path).engine.runner.model)
    monkeypatch.setattr(cls, "capabilities", replace(cls.capabilities, sliding_window_kv="paged"))
    with pytest.raises(UnsupportedFeatureError, match="sliding-window KV layout 'paged'"):
        make(path)


def test_long_prompts_match_transformers_through_chunks_and_preemption(hybrid, expected):
    _, _, path = hybrid
    prompts, want = expected
    got, _ = greedy(make(path), prompts)
    assert got == want
    # chunks of 16 tokens, and a cache too small for all five at once
    llm = make(path, max_num_batched_tokens=16, num_kv_blocks=40, max_model_len=192)
    got, outs = greedy(llm, prompts)
    assert got == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"
    llm.engine.check_no_leaks()
    got, _ = greedy(make(path, max_num_batched_tokens=16, async_scheduling=True), prompts)
    assert got == want


def test_long_prompt_logits_match_transformers(hybrid):
    _, model, path = hybrid
    prompts = prompts_of([9, 40, 100, 150], seed=6)
    llm = make(path, max_num_batched_tokens=512)  # all four prompts in one step
    with captured_logits(llm) as captured:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    assert len(captured) == 1 and captured[0].shape[0] == len(prompts)
    for prompt, row in zip(prompts, captured[0]):
        assert float((row - hf_last_logits(model, prompt)).abs().max()) < 1e-4


def test_blocks_behind_the_window_go_back_to_the_pool(hybrid):
    _, model, path = hybrid
    llm = make(path, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = prompts_of([100], seed=7)[0]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    req = engine.scheduler.requests["r"]
    while req.num_output_tokens < 8:
        engine.step()
    # the last step decoded position c - 1, which sees c - 8 .. c - 1
    c = req.num_computed_tokens
    full = -(-c // BS)
    sliding = full - (c - WINDOW) // BS
    assert sliding == 2
    assert engine.kv.num_held_blocks(req) == full + sliding_groups(llm) * sliding
    assert engine.num_free_blocks == engine.num_blocks - full - sliding_groups(llm) * sliding
    for table in req.block_tables[1:]:
        assert table[:full - sliding] == [NO_BLOCK] * (full - sliding) and NO_BLOCK not in table[full - sliding:]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].token_ids == hf_greedy(model, prompt, 12)
    engine.check_no_leaks()


def test_a_long_sequence_fits_where_full_length_sliding_layers_would_not(hybrid, monkeypatch):
    """The same KV memory: 44 one-layer blocks hold a request of 256 tokens when sliding layers keep
    their window (32 full-group blocks + 4 per sliding group at chunks of 16); keeping the whole
    sequence in every layer needs 32 blocks of all layers, 4x as much."""
    _, model, path = hybrid
    llm = make(path, device="cpu")  # (kv_cache_memory sizes the CPU's cache)
    cfg = llm.engine.model_config
    layer_block = 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4  # one layer's K and V of a block, float32
    groups = len(llm.engine.kv_layout.groups)
    memory = (32 + 4 * (groups - 1)) * layer_block
    llm = make(path, device="cpu", kv_cache_memory=memory, max_num_batched_tokens=16)  # max_model_len: what fits
    engine = llm.engine
    assert engine.num_blocks == 32 + 4 * (groups - 1) and engine.max_model_len == 256
    prompt = prompts_of([200], seed=8)[0]
    got, outs = greedy(llm, [prompt], 56)
    assert got == [hf_greedy(model, prompt, 56)] and outs[0].metrics["num_preemptions"] == 0
    engine.check_no_leaks()
    # Sliding layers in the global layers' table, the whole sequence: 256 tokens do not fit.
    from dataclasses import replace

    cls = engine.runtime.model_class
    monkeypatch.setattr(cls, "capabilities", replace(cls.capabilities, sliding_window_kv="full"))
    with pytest.raises(ConfigurationError, match="needs 32"):
        make(path, device="cpu", kv_cache_memory=memory, max_num_batched_tokens=16, max_model_len=256)
    full = make(path, device="cpu", kv_cache_memory=memory, max_num_batched_tokens=16)
    assert not full.engine.kv_layout.is_hybrid
    assert full.engine.max_model_len == (32 + 4 * (groups - 1)) // groups * BS  # blocks of every layer
    # (and that layout still runs the window layers right: they mask the full table)
    short = prompts_of([40], seed=9)[0]
    assert greedy(full, [short], 16)[0] == [hf_greedy(model, short, 16)]


def test_prefix_cache_hits_on_a_repeated_long_prompt(hybrid):
    _, model, path = hybrid
    llm = make(path, max_num_batched_tokens=16)
    prompt = prompts_of([100], seed=10)[0]
    first, outs = greedy(llm, [prompt], 8)
    assert outs[0].num_cached_tokens == 0
    # 12 full blocks: every one in the full group; the sliding groups' blocks 10 and 11 (what the
    # query at 96 sees), released as the window moved and kept by their hash
    second, outs = greedy(llm, [prompt], 8)
    assert outs[0].num_cached_tokens == 96 and second == first == [hf_greedy(model, prompt, 8)]
    # a shared 60-token prefix: 7 blocks
    other = prompt[:60] + prompts_of([30], seed=11)[0]
    got, outs = greedy(llm, [other], 8)
    assert outs[0].num_cached_tokens == 56 and got == [hf_greedy(model, other, 8)]
    # n > 1: the siblings wait for the first one's prompt KV and take it from the prefix cache
    fresh = prompts_of([77], seed=15)[0]
    hits = llm.engine.kv.num_hit_tokens
    out = llm.generate({"prompt_token_ids": fresh}, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    assert [c.token_ids for c in out[0].outputs] == [hf_greedy(model, fresh, 8)] * 3
    assert llm.engine.kv.num_hit_tokens - hits == 2 * 72
    llm.engine.check_no_leaks()


def test_preemption_and_cancellation_mid_prefill_free_everything(hybrid):
    _, model, path = hybrid
    llm = make(path, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = prompts_of([100], seed=12)[0]
    engine.add_request("gone", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    req = engine.scheduler.requests["gone"]
    for _ in range(3):
        engine.step()
    assert not req.prefill_done and req.block_tables[1][0] == NO_BLOCK  # the window has moved on
    engine.abort_request("gone")
    engine.check_no_leaks()
    # Two long requests in a cache too small for both: the newer one is preempted mid-prefill.
    llm = make(path, max_num_batched_tokens=16, num_kv_blocks=40, max_model_len=160, enable_prefix_caching=False)
    engine = llm.engine
    seen = []
    preempt = engine.scheduler._preempt

    def record(victim, out):
        during_prefill = not victim.prefill_done
        preempt(victim, out)
        seen.append((during_prefill, victim.block_tables))

    engine.scheduler._preempt = record
    prompts = prompts_of([100, 120], seed=13)
    got, _ = greedy(llm, prompts, 40)
    assert got == [hf_greedy(model, p, 40) for p in prompts]
    assert any(during_prefill for during_prefill, _ in seen) and all(tables == [] for _, tables in seen)
    engine.check_no_leaks()


def test_triton_kernel_path_with_per_group_tables(hybrid):
    """The runner's kernel metadata (a flat table per KV group, NO_BLOCK behind the windows) through
    the Triton attention kernel (interpreted on the CPU), scheduled asynchronously as on CUDA:
    greedy tokens equal transformers'."""
    _, model, path = hybrid
    prompts = prompts_of([3, 41], seed=14)  # the longer one: five windows, two chunks
    llm = make(path, max_num_batched_tokens=24, async_scheduling=True)
    llm.engine.runner.use_kernels = True
    got, _ = greedy(llm, prompts, 6)
    assert got == [hf_greedy(model, p, 6) for p in prompts]
    llm.engine.check_no_leaks()
