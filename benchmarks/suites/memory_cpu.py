"""Peak resident memory of the engine serving a GGUF on the CPU, against the file size.

    python benchmarks/suites/memory_cpu.py [MODEL.gguf] [--output-json PATH]

Reports the load's time and peak RSS (VmHWM right after loading, against the RSS then), the
process's peak RSS after a generation, and the part the model brought: peak minus the RSS of the
same process after importing torch and PocketLLM (the interpreter and libraries). The budget
is 1.5x the file size plus the KV cache the engine allocated.
"""
from __future__ import annotations

import argparse
import os
import random
import time


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import torch  # noqa: F401  (the baseline includes torch and PocketLLM themselves)

    from pocketllm import LLM, SamplingParams
    from pocketllm.bench.report import environment, write_json
    from pocketllm.pull import pull_default_model

    path = args.model or str(pull_default_model())
    baseline = rss("VmRSS")
    t0 = time.perf_counter()
    llm = LLM(path, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    load_s = time.perf_counter() - t0
    after_load, load_peak = rss("VmRSS"), rss("VmHWM")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(128)]} for _ in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    peak = rss("VmHWM")
    eng = llm.engine
    kv_bytes = sum(t.numel() * t.element_size() for t in eng.runner.k_caches + eng.runner.v_caches)
    file_size = os.path.getsize(path)
    model_peak = peak - baseline
    result = {
        **environment(), "model": path, "file_bytes": file_size, "kv_cache_bytes": kv_bytes,
        "rss_baseline_bytes": baseline, "rss_after_load_bytes": after_load, "peak_rss_bytes": peak,
        "model_peak_bytes": model_peak, "load_s": load_s, "load_peak_rss_bytes": load_peak,
        "load_peak_over_after_load_bytes": load_peak - after_load, "budget_bytes": int(1.5 * file_size + kv_bytes),
        "model_peak_over_file": model_peak / file_size,
        "within_budget": model_peak <= 1.5 * file_size + kv_bytes,
    }
    print(f"{'load_s':>22}: {load_s:8.2f} s")
    for k in ("file_bytes", "kv_cache_bytes", "rss_baseline_bytes", "rss_after_load_bytes", "load_peak_rss_bytes",
              "peak_rss_bytes", "model_peak_bytes", "budget_bytes"):
        print(f"{k:>22}: {result[k] / 2**20:8.1f} MiB")
    print(f"{'within_budget':>22}: {result['within_budget']}")
    write_json(args.output_json, result)


if __name__ == "__main__":
    main()
