"""Single-stream CPU decode on the fast path with one of its one-C-call parts on and off, alternated
in one process on one loaded model, 2 threads:

- ``--part experts`` (a mixture-of-experts file): a token's selected experts in one C call
  (layers.moe.SparseMoE -> kernels.cpu.llama_decode.DecodeExperts) or the experts' modules in turn;
  then one block alone (layer 0's, a random hidden state, the router included), each way in turn
  ``--block-calls`` times a round, the rounds alternated: what the one call saves, out of the
  decode step's noise;
- ``--part layers``: every decoder layer of a decode step in one C call (LlamaDecoder) or the
  modules one by one.

    python benchmarks/suites/cpu_one_call.py /tmp/pocketllm-cpu-bench/gpt-oss-20b-MXFP4_MOE.gguf [--reps 3]
    python benchmarks/suites/cpu_one_call.py /tmp/pocketllm-cpu-bench/qwen3-0.6b-Q4_K_M.gguf --part layers --reps 7
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
    ap.add_argument("--part", choices=("experts", "layers"), default="experts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=512)
    model = llm.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def tok_s(one_call: bool, seed: int) -> float:
        if args.part == "layers":
            model._cpu_decoder = None if one_call else False  # None: built at the next decode-only step
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
    labels = {"experts": ("experts in one C call", "experts' modules in turn"),
              "layers": ("layers in one C call", "modules one by one")}[args.part]
    for one_call, label in zip((True, False), labels):
        print(f"{label:26s} " + " ".join(f"{v:6.2f}" for v in runs[one_call])
              + f"  median {statistics.median(runs[one_call]):.2f} tok/s")
    print(f"ratio of medians {statistics.median(runs[True]) / statistics.median(runs[False]):.3f}x")
    if args.part != "experts":
        return
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
