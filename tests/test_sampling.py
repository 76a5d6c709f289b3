"""Sampler behaviour against plain references and through the engine."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import prompts_of
from reference import plain_penalties

from pocketllm import LLM, SamplingParams
from pocketllm.core.request import Request
from pocketllm.runner.sampler import Sampler, apply_penalties


def test_penalties_match_a_plain_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    cases = [([1, 2, 3], [3, 3, 7], 1.3, 0.5, 0.2), ([4], [], 0.8, -0.4, 1.0), ([9, 9], [1, 1, 1, 2], 1.0, 2.0, -2.0)]
    reqs, rows = [], []
    for prompt, output, rep, freq, pres in cases:
        r = Request("x", prompt, SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                                presence_penalty=pres))
        for t in output:
            r.append_output_token(t)
        reqs.append(r)
        rows.append(torch.randn(vocab, generator=g))
    got = apply_penalties(torch.stack(rows), reqs, vocab)
    for i, (prompt, output, rep, freq, pres) in enumerate(cases):
        want = plain_penalties(rows[i].tolist(), prompt, output, rep, freq, pres)
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-6)


def test_logit_bias_min_tokens_and_top_k_1():
    vocab = 20
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    best = int(logits[0].argmin())
    biased = Request("a", [0], SamplingParams(temperature=0, logit_bias={best: 100.0}))
    eos = int(logits[1].argmax())
    banned = Request("b", [0], SamplingParams(temperature=0, min_tokens=2), eos_token_ids=frozenset({eos}))
    topk1 = Request("c", [0], SamplingParams(temperature=0.9, top_k=1, seed=3))
    out = Sampler()(logits, [biased, banned, topk1])
    assert out[0].token_id == best
    assert out[1].token_id != eos and out[1].token_id == int(logits[1].topk(2).indices[1])
    assert out[2].token_id == int(logits[2].argmax())


def test_top_p_and_min_p_never_pick_excluded_tokens():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]] * 2)
    for _ in range(50):
        reqs = [Request("p", [0], SamplingParams(top_p=0.6)), Request("m", [0], SamplingParams(min_p=0.5))]
        out = Sampler(seed=_)(logits, reqs)
        assert out[0].token_id in (0, 1) and out[1].token_id in (0, 1)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(seed=0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, [Request("r", [0], SamplingParams(temperature=1.0))])[0].token_id] += 1
    for c, p in zip(counts, [0.5, 0.3, 0.2]):
        assert abs(c / 3000 - p) < 0.035


def test_logprobs_are_log_softmax_of_the_model_logits():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, [Request("r", [0], SamplingParams(temperature=0, logprobs=3))])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert out.rank == 1 and math.isclose(out.logprob, float(ref.max()), abs_tol=1e-6)
    assert [t for t, _ in out.top] == ref.topk(3).indices.tolist()


@pytest.fixture(scope="module")
def llama_llm(tiny_models):
    return LLM(str(tiny_models["llama"][1]), dtype="float32")


def test_seeded_sampling_is_independent_of_the_batch(llama_llm):
    prompts = prompts_of([7, 20, 3, 40], seed=5)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    alone = llama_llm.generate({"prompt_token_ids": prompts[0]}, seeded)[0].outputs[0].token_ids
    mixed = llama_llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [other, seeded, other, other])
    batch = llama_llm.generate([{"prompt_token_ids": p} for p in [prompts[1], prompts[0]]],
                               [other, seeded])
    assert batch[1].outputs[0].token_ids == alone
    assert mixed[1].prompt_token_ids == prompts[1]
    again = llama_llm.generate([{"prompt_token_ids": prompts[2]}, {"prompt_token_ids": prompts[0]}],
                               [other, seeded])
    assert again[1].outputs[0].token_ids == alone
    llama_llm.engine.check_no_leaks()


def test_top_k_1_equals_greedy(llama_llm):
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 30], seed=9)]
    greedy = llama_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    topk = llama_llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]


def test_n_siblings_share_the_prompt_blocks(llama_llm):
    prompt = prompts_of([40], seed=11)[0]
    hits_before = llama_llm.engine.kv.num_hit_tokens
    out = llama_llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    # Siblings 1 and 2 adopted the leader's two full prompt blocks instead of recomputing them.
    assert llama_llm.engine.kv.num_hit_tokens - hits_before == 2 * 32
    llama_llm.engine.check_no_leaks()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_transformers(tiny_models, async_scheduling):
    """Each prompt token's logprob given the ones before it: transformers' log-softmax at every
    position, whether the prompt comes in one step or in chunks, a second time (no prefix-cache hit
    without logits), next to other requests, and for n = 2 (one copy)."""
    model, path = tiny_models["llama"]
    prompts = prompts_of([40, 1, 23], seed=9)
    with torch.no_grad():
        refs = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    for chunk, blocks in ((2048, None), (16, None), (16, 5)):  # 5 blocks: requests get preempted and recomputed
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=chunk, num_kv_blocks=blocks,
                  max_model_len=64, async_scheduling=async_scheduling)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
        plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}],
                                [params, params, dataclasses.replace(params, n=2), plain])
            for out, p, ref in zip(outs, prompts, refs):
                lps = out.prompt_logprobs
                assert len(lps) == len(p) and lps[0] is None
                for k, entry in enumerate(lps[1:]):
                    (tok, got), *top = entry.items()
                    assert tok == p[k + 1]
                    assert abs(got.logprob - float(ref[k, tok])) < 1e-4
                    assert got.rank == int((ref[k] > ref[k, tok]).sum()) + 1
                    best = ref[k].topk(2).indices.tolist()
                    assert [t for t, _ in top] == [t for t in best if t != tok][:len(top)]
            assert outs[3].prompt_logprobs is None
            if blocks:
                assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        llm.engine.check_no_leaks()
