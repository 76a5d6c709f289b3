"""Greedy tokens and logits against transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from conftest import prompts_of
from pocketllm import LLM, SamplingParams

LENGTHS = [1, 5, 17, 33, 48, 70]
NEW = 32


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


@pytest.fixture
def reference(tiny):
    model, path = tiny
    prompts = prompts_of(LENGTHS)
    return path, prompts, [hf_greedy(model, p) for p in prompts], model


def run(path, prompts, **engine_args):
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
    llm = LLM(str(path), dtype="float32")
    captured = []
    model_rt = llm.engine.runner.model
    original = model_rt.compute_logits
    model_rt.compute_logits = lambda h: captured.append(original(h).cpu()) or captured[-1]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    ours = torch.cat(captured)  # one row per prompt, in batch order
    rows = {len(p): hf_last_logits(model, p) for p in prompts}
    assert ours.shape[0] == len(prompts)
    for row in ours:
        diffs = [float((row - ref).abs().max()) for ref in rows.values()]
        assert min(diffs) < 1e-4, diffs


def test_batch_invariance(reference):
    path, prompts, expected, _ = reference
    alone = [run(path, [p])[0][0] for p in prompts[:3]]
    assert alone == expected[:3]
    chunked, _, _ = run(path, prompts, max_num_batched_tokens=8)
    assert chunked == expected
    tight, outs, llm = run(path, prompts, num_kv_blocks=9, max_model_len=128)
    assert tight == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"
