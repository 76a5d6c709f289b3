"""Accuracy of an 8-bit KV cache against the model's-dtype one on real text, teacher-forced: the default
model's predictions at every position of 2,048 tokens (this repository's README and Python's
LICENSE.txt), read back from the cache in 256-token chunks; top-1 agreement and mean KL(float || 8-bit)
in nats, on the CPU's fast path and its exact one (or on a GPU with --device cuda).

    python benchmarks/suites/kv_cache_accuracy.py [--device cpu] [--kv int8] > benchmarks/results/cpu-kv-cache-accuracy.json
"""
from __future__ import annotations

import argparse
import json

from cpu_fast_path_accuracy import default_model, real_text, teacher_forced

from pocketllm import LLM
from pocketllm.bench.report import environment

TOKENS = 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv", default="int8", help="the 8-bit cache: int8 or fp8")
    a = parser.parse_args()
    model = a.model or default_model()
    rows = []
    for exact in ((False, True) if a.device == "cpu" else (False,)):
        logp = {}
        for kv in ("auto", a.kv):
            llm = LLM(model, device=a.device, kv_cache_dtype=kv, exact_kernels=exact, max_model_len=TOKENS + 64,
                      enable_prefix_caching=False)
            ids = llm.get_tokenizer().encode(real_text())[:TOKENS]
            logp[kv] = teacher_forced(llm, ids)
        ref, quant = logp["auto"], logp[a.kv]
        kl = (ref.exp() * (ref - quant)).sum(-1)
        rows.append({"kernels": "exact" if exact else "fast", "kv_cache_dtype": a.kv, "tokens_scored": ref.shape[0],
                     "top1_agreement": (ref.argmax(-1) == quant.argmax(-1)).double().mean().item(),
                     "mean_kl_nats": kl.mean().item(), "p99_kl_nats": kl.quantile(0.99).item(),
                     "max_kl_nats": kl.max().item()})
    print(json.dumps({**environment(), "model": model, "device": a.device,
                      "text": "README.md + Python's LICENSE.txt, 256-token chunks", "reference": "kv_cache_dtype auto",
                      "rows": rows, "goal": {"top1_agreement": ">= 0.99 (issue 44)"}}, indent=1))


if __name__ == "__main__":
    main()
