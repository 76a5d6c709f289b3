"""Where a single-stream CPU decode step's time goes: the whole step with the layers in one C call
(where the model's runtime has it) and module by module; module by module with every GGUF matmul
replaced by an empty result of its shape (what is left: norms, attention, activations, Python and
bookkeeping); and each matmul shape's time per call (timed around the layer call). Then a
512-token prefill: its time, each matmul shape's and attention's.

    python benchmarks/tools/profile_cpu_step.py MODEL.gguf [--exact-kernels] >> benchmarks/results/cpu-fast-path-profile.txt
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from pocketllm import LLM, SamplingParams
from pocketllm.bench.report import environment
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.quant import linear as qlinear

TOKENS = 64
PREFILL = 512


def ms_per_token(llm: LLM) -> float:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5] * 16}, params)  # warm-up
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": [7] * 16}, params)
    return (time.perf_counter() - t0) / TOKENS * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--exact-kernels", action="store_true")
    args = ap.parse_args()
    env = environment()
    llm = LLM(args.model, exact_kernels=args.exact_kernels, max_model_len=2 * PREFILL, enable_prefix_caching=False,
              max_num_batched_tokens=PREFILL)
    print(f"# {args.model}, exact_kernels={args.exact_kernels}; commit {env['commit']}"
          f"{' (dirty)' if env['dirty'] else ''}, {env['machine']['cpu']}, {env['machine']['torch_threads']} "
          f"threads, {env['date']}; 16-token prompt, {TOKENS} tokens")
    model = llm.engine.runner.model
    full = ms_per_token(llm)
    one_call = None
    if getattr(model, "_cpu_decoder", None):  # built: that was one C call
        one_call, model._cpu_decoder = full, False  # module by module from here: matmuls timed, stubbed
        full = ms_per_token(llm)

    times, calls = collections.defaultdict(float), collections.Counter()
    forward = qlinear.GGUFLinear.forward

    def timed(self, x):
        t0 = time.perf_counter()
        y = forward(self, x)
        rows = x.numel() // self.in_features
        if rows == 1:
            key = (self.qtype.name, self.out_features, self.in_features)
            times[key] += time.perf_counter() - t0
            calls[key] += 1
        return y

    qlinear.GGUFLinear.forward = timed
    try:
        with_timers = ms_per_token(llm)  # a warm-up request and a timed one
    finally:
        qlinear.GGUFLinear.forward = forward
    steps = 2 * (TOKENS - 1)  # decode steps of the two requests (their first tokens come from prefills)
    gemm, gemm_x8 = gguf_ops.gemm, gguf_ops.gemm_x8
    gguf_ops.gemm = lambda x, rows, qtype, int8=0, lib=None: torch.empty(x.shape[0], rows.numel())
    gguf_ops.gemm_x8 = lambda x, packed, n, qtype, passes=1, lib=None: torch.empty(x.shape[0], n)
    try:
        no_matmul = ms_per_token(llm)
    finally:
        gguf_ops.gemm, gguf_ops.gemm_x8 = gemm, gemm_x8
    per_step = sum(times.values()) * 1e3 / steps
    if one_call is not None:
        print(f"step with the layers in one C call {one_call:.2f} ms")
    print(f"step module by module {full:.2f} ms; without the matmuls {no_matmul:.2f} ms ({no_matmul / full:.0%}); "
          f"matmul layer calls {per_step:.2f} ms per step (timed, {with_timers:.2f} ms/token with timers)")
    print("  type    N       K      us/call  calls/step  GB/s of weights")
    for key, t in sorted(times.items(), key=lambda kv: -kv[1]):
        qtype, n, k = key
        per_call = t / calls[key]
        nbytes = n * qlinear.row_nbytes(qlinear.T[qtype], k)
        print(f"  {qtype:6} {n:<7} {k:<6} {per_call * 1e6:8.1f} {calls[key] / steps:8.0f}"
              f"      {nbytes / per_call / 1e9:6.1f}")

    prefill_profile(llm)


def prefill_profile(llm: LLM) -> None:
    from pocketllm.models import llama

    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate({"prompt_token_ids": [5] * PREFILL}, params)  # warm-up
    times: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    forward, attention = qlinear.GGUFLinear.forward, llama.paged_attention

    def timed(self, x):
        t0 = time.perf_counter()
        y = forward(self, x)
        if x.numel() // self.in_features == PREFILL:
            key = (self.qtype.name, self.out_features, self.in_features)
            times[key] += time.perf_counter() - t0
            calls[key] += 1
        return y

    def timed_attention(*args, **kwargs):
        t0 = time.perf_counter()
        out = attention(*args, **kwargs)
        times["attention"] += time.perf_counter() - t0
        return out

    qlinear.GGUFLinear.forward, llama.paged_attention = timed, timed_attention
    try:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": [7] * PREFILL}, params)
        total = time.perf_counter() - t0
    finally:
        qlinear.GGUFLinear.forward, llama.paged_attention = forward, attention
    attn = times.pop("attention", 0.0)
    print(f"prefill of {PREFILL} tokens {total * 1e3:.0f} ms ({PREFILL / total:.0f} tok/s): matmuls "
          f"{sum(times.values()) * 1e3:.0f} ms, attention {attn * 1e3:.0f} ms, the rest "
          f"{(total - attn - sum(times.values())) * 1e3:.0f} ms")
    print("  type    N       K      ms (all layers)  GMAC/s")
    for key, t in sorted(times.items(), key=lambda kv: -kv[1]):
        qtype, n, k = key
        print(f"  {qtype:6} {n:<7} {k:<6} {t * 1e3:10.0f} {n * k * PREFILL * calls[key] / t / 1e9:14.0f}")


if __name__ == "__main__":
    main()
