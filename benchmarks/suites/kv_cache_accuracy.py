"""Accuracy of an 8-bit KV cache against the model's-dtype one on real text, teacher-forced: the default
model's predictions at every position of 2,048 tokens (this repository's README and Python's
LICENSE.txt), read back from the cache in 256-token chunks; top-1 agreement and mean KL(float || 8-bit)
in nats, on the CPU's fast path and its exact one (or on a GPU with --device cuda).

With --study (CPU), also other roundings measured on the exact path with the float cache: what is written is
rounded by the reference quantizer first (keys or values alone, keys in smaller groups, fp8), to see where
the disagreement comes from. These are studies, not settings the engine ships.

    cd benchmarks/suites && python kv_cache_accuracy.py [--device cpu] [--kv int8] [--study] \
        > ../results/cpu-kv-cache-accuracy.json
"""
from __future__ import annotations

import argparse
import json

from cpu_fast_path_accuracy import default_model, real_text, teacher_forced

import pocketllm.layers.attention as attention
from pocketllm import LLM
from pocketllm.bench.report import environment
from pocketllm.core.kv_dtype import QUANTS, dequantize, quantize

TOKENS = 2048


def rounded(x, group: int | None, fmt: str):
    """x rounded as a cache of `fmt` with a scale per `group` values would hold it (None: untouched)."""
    if group is None:
        return x
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    values, scales = quantize(g, QUANTS[fmt])
    return dequantize(values, scales, x.dtype).reshape(x.shape)


def study(model: str) -> list[dict]:
    """Roundings of keys and values (group sizes, format) on the exact path, against no rounding."""
    write = attention.write_kv
    setting = {}

    def rounding_write(k_cache, v_cache, k, v, slots, k_scale=None, v_scale=None):
        write(k_cache, v_cache, rounded(k, setting["k"], setting["fmt"]), rounded(v, setting["v"], setting["fmt"]), slots)

    attention.write_kv = rounding_write
    llm = LLM(model, exact_kernels=True, max_model_len=TOKENS + 64, enable_prefix_caching=False)
    ids = llm.get_tokenizer().encode(real_text())[:TOKENS]
    rows = []
    try:
        setting.update(k=None, v=None, fmt="int8")
        ref = teacher_forced(llm, ids)
        for k, v, fmt in [(64, 64, "int8"), (64, None, "int8"), (None, 64, "int8"), (32, 32, "int8"),
                          (16, 64, "int8"), (64, 64, "fp8")]:
            setting.update(k=k, v=v, fmt=fmt)
            out = teacher_forced(llm, ids)
            rows.append({"keys_group": k, "values_group": v, "format": fmt,
                         "top1_agreement": (ref.argmax(-1) == out.argmax(-1)).double().mean().item(),
                         "mean_kl_nats": (ref.exp() * (ref - out)).sum(-1).mean().item()})
    finally:
        attention.write_kv = write
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv", default="int8", help="the 8-bit cache: int8 or fp8")
    parser.add_argument("--study", action="store_true", help="also the roundings of keys and values (CPU)")
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
                      "rows": rows, **({"study_exact_path": study(model)} if a.study else {}),
                      "goal": {"top1_agreement": ">= 0.99 (issue 44)"}}, indent=1))


if __name__ == "__main__":
    main()
