"""transformers as the reference, and a look at the logits the engine really computed."""
from __future__ import annotations

from contextlib import contextmanager

import torch


def hf_greedy(model, prompt: list[int], new: int, pad_token_id: int = 0) -> list[int]:
    """transformers' greedy continuation of one prompt. An explicit all-ones mask: `generate` would
    otherwise mask prompt tokens equal to the pad token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=pad_token_id)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


@contextmanager
def captured_logits(llm):
    """Records every logits batch the engine samples from (on the CPU), in step order."""
    rt = llm.engine.runner.model
    original = rt.compute_logits
    captured: list[torch.Tensor] = []

    def record(hidden):
        logits = original(hidden)
        captured.append(logits.cpu())
        return logits

    rt.compute_logits = record
    try:
        yield captured
    finally:
        rt.compute_logits = original


def plain_penalties(logits, prompt, output, rep, freq, pres):
    """Penalties by their definitions, one token at a time: repetition (as transformers) over
    prompt and output, frequency and presence (as OpenAI) over the output."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        c = output.count(t)
        out[t] -= freq * c + pres * (1 if c else 0)
    return out
