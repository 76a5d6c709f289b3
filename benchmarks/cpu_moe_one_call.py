"""Single-stream CPU decode of a mixture-of-experts GGUF file with a token's experts in one C call
(layers.moe.SparseMoE -> kernels.cpu.llama_decode.DecodeExperts) and without it (the experts'
modules in turn), alternated in one process on one loaded model, the fast path, 2 threads.

    python benchmarks/cpu_moe_one_call.py /tmp/pocketllm-cpu-bench/gpt-oss-20b-MXFP4_MOE.gguf [--reps 3]

Then one block alone (layer 0's, a random hidden state, the router included), each way in turn
``--block-calls`` times a round, the rounds alternated: what the one call saves, out of the
decode step's noise.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pocketllm import LLM, SamplingParams
from pocketllm.bench.report import environment
from pocketllm.layers.moe import SparseMoE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=512)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def tok_s(one_call: bool, seed: int) -> float:
        for m in blocks:
            m._cpu_experts = None if one_call else False  # None: built at the next one-token step
        llm.generate({"prompt_token_ids": [seed] * 16}, SamplingParams(max_tokens=2, temperature=0))  # warm-up
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": [seed + 1] * 16}, params)
        return args.tokens / (time.perf_counter() - t0)

    runs: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for one_call in (True, False):
            runs[one_call].append(tok_s(one_call, 10 * rep + 3))
    env = environment()
    print(f"# {args.model}; commit {env['commit']}{' (dirty)' if env.get('dirty') else ''}, {env['machine']['cpu']}, "
          f"{args.threads} threads, {env['date']}; 16-token prompts, {args.tokens} generated, alternated")
    for one_call, label in ((True, "experts in one C call"), (False, "experts' modules in turn")):
        print(f"{label:26s} " + " ".join(f"{v:6.2f}" for v in runs[one_call])
              + f"  median {statistics.median(runs[one_call]):.2f} tok/s")
    print(f"ratio of medians {statistics.median(runs[True]) / statistics.median(runs[False]):.3f}x")

    block = blocks[0]
    x = torch.randn(1, block.gate.in_features, generator=torch.Generator().manual_seed(0))
    us: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(args.reps):
            for one_call in (True, False):
                block._cpu_experts = None if one_call else False
                block(x)
                t0 = time.perf_counter()
                for _ in range(args.block_calls):
                    block(x)
                us[one_call].append((time.perf_counter() - t0) / args.block_calls * 1e6)
    for one_call, label in ((True, "experts in one C call"), (False, "experts' modules in turn")):
        print(f"block 0, {label:26s} " + " ".join(f"{v:7.1f}" for v in us[one_call])
              + f"  median {statistics.median(us[one_call]):.1f} us")


if __name__ == "__main__":
    main()
