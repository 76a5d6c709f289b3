"""Where a GPU decode step's time goes: host phases from the engine's step stats, and the
kernels by total GPU time from torch.profiler, at the given batch sizes.

    python benchmarks/tools/profile_gpu_step.py llama3-8b --batch 1,64 --output-json OUT.json   # random bf16 weights
    python benchmarks/tools/profile_gpu_step.py model.gguf --batch 1 --output-json OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from pocketllm.bench.offline import random_prompts
from pocketllm.bench.report import environment
from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="kernels listed, by GPU time")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    engine = LLMEngine(EngineArgs(model=args.model, load_format="auto" if args.model.endswith(".gguf") else "dummy",
                                  dtype="bfloat16", max_model_len=1024,
                                  max_num_seqs=max(batches), enforce_eager=args.enforce_eager))
    report = {**environment(), "model": args.model, "enforce_eager": args.enforce_eager, "batches": {}}
    for b in batches:
        prompts = random_prompts(b, args.input_len, engine.model_config.vocab_size, seed=b)
        params = SamplingParams(temperature=0, max_tokens=10 * args.steps, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"p{b}-{i}", {"prompt_token_ids": p}, params)
        while engine.last_step.num_decodes != b or engine.last_step.num_seqs != b:
            engine.step()  # prefill until every row decodes
        for _ in range(4):
            engine.step()
        stats = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
                stats.append(engine.last_step)
        torch.cuda.synchronize()
        kernels = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                         key=lambda e: -e.device_time_total)
        total_gpu = sum(e.device_time_total for e in kernels)
        med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        row = {
            "step_ms": med([s.total_time for s in stats]),
            "schedule_ms": med([s.schedule_time for s in stats]),
            "prepare_ms": med([s.prepare_time for s in stats]),
            "forward_and_sample_ms": med([s.forward_time for s in stats]),
            "gpu_busy_ms_per_step": total_gpu / 1e3 / args.steps,
            "launches_per_step": sum(e.count for e in kernels) / args.steps,
            "tok_s": b / statistics.median([s.total_time for s in stats]),
            "top_kernels": [{"name": e.key[:90], "ms_per_step": e.device_time_total / 1e3 / args.steps,
                             "calls_per_step": e.count / args.steps} for e in kernels[:args.top]],
        }
        report["batches"][str(b)] = row
        print(f"batch {b}: step {row['step_ms']:.2f} ms ({row['tok_s']:.0f} tok/s), "
              f"GPU busy {row['gpu_busy_ms_per_step']:.2f} ms in {row['launches_per_step']:.0f} kernels, "
              f"schedule {row['schedule_ms']:.2f}, "
              f"prepare {row['prepare_ms']:.2f}, forward+sample {row['forward_and_sample_ms']:.2f}")
        for k in row["top_kernels"]:
            print(f"   {k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  {k['name']}")
        for i in range(b):
            engine.abort_request(f"p{b}-{i}")
        engine.step()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
