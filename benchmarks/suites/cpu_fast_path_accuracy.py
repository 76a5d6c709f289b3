"""Accuracy of the CPU fast path (exact_kernels=False) against the exact one on real text,
teacher-forced: the default model's logits at every position of a 2,000+ token text (this
repository's README and Python's LICENSE.txt), full vocabulary: top-1 agreement and mean KL
divergence KL(exact || fast) in nats.

    python benchmarks/suites/cpu_fast_path_accuracy.py [MODEL.gguf] > benchmarks/results/cpu-fast-path-accuracy.json
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import torch

from pocketllm import LLM, SamplingParams
from pocketllm.bench.report import environment

ROOT = Path(__file__).resolve().parents[2]
MIN_TOKENS = 2000


def default_model() -> str:
    shared = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if shared.is_file():
        return str(shared)
    from pocketllm.pull import pull_default_model
    return str(pull_default_model())


def real_text() -> str:
    parts = [ROOT / "README.md", Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"]
    return "\n\n".join(p.read_text() for p in parts if p.is_file())


def prompt_logits(model: str, ids: list[int], exact: bool) -> torch.Tensor:
    """log-softmax [len(ids) - 1, vocab] of the predictions of tokens 1.. (one prefill pass)."""
    llm = LLM(model, exact_kernels=exact, max_model_len=len(ids) + 16, enable_prefix_caching=False,
              max_num_batched_tokens=len(ids))
    return teacher_forced(llm, ids)


def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """prompt_logits on a loaded engine (its context must hold `ids` in one step)."""
    rt = llm.engine.runner.model
    original, captured = rt.compute_logits, []
    rt.compute_logits = lambda hidden: captured.append(original(hidden)) or captured[-1]
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                     use_tqdm=False)
    finally:
        rt.compute_logits = original
    # the prompt's rows come in chunks, in order; the one sampled row is a call of its own
    full = torch.cat([t for t in captured if t.shape[0] > 1])
    assert full.shape[0] == len(ids) - 1, full.shape
    return torch.log_softmax(full[:len(ids) - 1].double(), dim=-1)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else default_model()
    tok = LLM(model, max_model_len=64, num_kv_blocks=8).get_tokenizer()
    ids = tok.encode(real_text())
    assert len(ids) > MIN_TOKENS, len(ids)
    ids = ids[:4096]
    exact, fast = prompt_logits(model, ids, True), prompt_logits(model, ids, False)
    agree = (exact.argmax(-1) == fast.argmax(-1)).double().mean().item()
    kl = (exact.exp() * (exact - fast)).sum(-1)
    print(json.dumps({**environment(), "model": model,
                      "text": "README.md + Python's LICENSE.txt", "tokens_scored": exact.shape[0],
                      "top1_agreement": agree, "mean_kl_nats": kl.mean().item(),
                      "p99_kl_nats": kl.quantile(0.99).item(), "max_kl_nats": kl.max().item(),
                      "goal": {"top1_agreement": ">= 0.97", "mean_kl_nats": "<= 0.01"}}, indent=1))


if __name__ == "__main__":
    main()
