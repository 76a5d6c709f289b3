"""Greedy tokens and logits against transformers on the same weights."""
from __future__ import annotations

import pytest
from conftest import prompts_of
from reference import captured_logits, hf_greedy, hf_last_logits

from pocketllm import LLM, SamplingParams

LENGTHS = [1, 5, 17, 33, 48, 70]
NEW = 32


@pytest.fixture
def reference(tiny):
    model, path = tiny
    prompts = prompts_of(LENGTHS)
    return path, prompts, [hf_greedy(model, p, NEW) for p in prompts], model


def tight_blocks(path) -> int:
    """A KV cache small enough to force preemption: 9 blocks of every layer (a model with
    sliding-window layers has blocks of fewer layers, several per token block)."""
    from pocketllm.config import EngineArgs, ModelConfig
    from pocketllm.models.registry import select_runtime

    cfg = ModelConfig.from_hf_dir(path)
    layout = select_runtime(cfg, EngineArgs(model=str(path)), "cpu", "float32").kv_layout
    return 9 * cfg.num_layers // layout.layers_per_block


def run(path, prompts, **engine_args):
    engine_args = {"exact_kernels": True, **engine_args}  # the exact path unless a test says otherwise
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs], outs, llm


def test_greedy_tokens_match_transformers(reference):
    path, prompts, expected, _ = reference
    got, _, _ = run(path, prompts)
    assert got == expected


def test_last_position_logits_match_transformers(reference):
    path, prompts, _, model = reference
    llm = LLM(str(path), dtype="float32", exact_kernels=True, max_num_batched_tokens=2048)  # one step
    with captured_logits(llm) as captured:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    # One step: the 1-token prompt is a query-length-1 row (placed first), then the others in
    # admission order -- the order of `prompts`.
    assert len(captured) == 1 and captured[0].shape[0] == len(prompts)
    for prompt, row in zip(prompts, captured[0]):
        assert float((row - hf_last_logits(model, prompt)).abs().max()) < 1e-4


def test_batch_invariance(reference):
    path, prompts, expected, _ = reference
    alone = [run(path, [p])[0][0] for p in prompts[:3]]
    assert alone == expected[:3]
    chunked, _, _ = run(path, prompts, max_num_batched_tokens=8)
    assert chunked == expected
    tight, outs, llm = run(path, prompts, num_kv_blocks=tight_blocks(path), max_model_len=128)
    assert tight == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"


def test_async_scheduling_gives_the_same_tokens(reference):
    """Each step scheduled and launched while the one before is still in flight
    (--async-scheduling; the same logic on the CPU, where a launch completes at once): decode rows
    take their input token from the previous step's output, through chunked prefill, preemption
    with a token in flight, and stops."""
    path, prompts, expected, _ = reference
    got, _, _ = run(path, prompts, async_scheduling=True)
    assert got == expected
    chunked, _, _ = run(path, prompts, async_scheduling=True, max_num_batched_tokens=8)
    assert chunked == expected
    tight, outs, _ = run(path, prompts, async_scheduling=True, num_kv_blocks=tight_blocks(path), max_model_len=128)
    assert tight == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"

    llm = LLM(str(path), dtype="float32", async_scheduling=True, exact_kernels=True)
    stop_at = expected[2][6]
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": prompts[2]}, {"prompt_token_ids": prompts[3]}], params)
    first = expected[2].index(stop_at)
    assert outs[0].outputs[0].token_ids == expected[2][:first + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == expected[3][:5]
    llm.engine.check_no_leaks()


def test_cpu_fast_path_layer_kernels_match_transformers(reference):
    """exact_kernels=False on float32 weights: no integer matmuls, only the fused C layer kernels
    (norms, rotary, cache write and decode attention, gated activation), which differ from
    torch's ops by float rounding alone: the same greedy tokens, through chunked prefill and
    preemption (mixed decode and prefill steps) as well."""
    path, prompts, expected, _ = reference
    got, _, llm = run(path, prompts, exact_kernels=False, device="cpu")  # the CPU path, also where a GPU is
    fused = [m for m in llm.engine.runner.model.modules() if hasattr(m, "kernels")]
    assert fused and all(m.kernels.cpu_fused for m in fused)
    assert got == expected
    tight, outs, _ = run(path, prompts, exact_kernels=False, num_kv_blocks=tight_blocks(path), max_model_len=128,
                         max_num_batched_tokens=8, device="cpu")
    assert tight == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
