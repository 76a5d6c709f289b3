"""`pocketllm bench latency` and `pocketllm bench throughput`: the offline engine, random prompts,
fixed input and output lengths (EOS ignored), side by side at several concurrencies."""
from __future__ import annotations

import argparse
import random
import resource
import time

from pocketllm.bench.report import environment, percentile, print_table, write_json
from pocketllm.cli.args import add_engine_args, engine_args_from
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_args(parser)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="generated tokens per request, EOS ignored (default: 128)")
    if command == "throughput":
        parser.add_argument("--num-prompts", type=int, default=64,
                            help="requests per concurrency level, at least the concurrency (default: 64)")
        parser.add_argument("--max-concurrency", type=str, default="8",
                            help="in-flight requests; a comma list runs a sweep, e.g. 1,8")
    else:
        parser.add_argument("--batch-size", type=int, default=1, help="requests run together (default: 1)")
        parser.add_argument("--num-iters", type=int, default=3, help="timed runs; the fastest is kept (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs")
    parser.add_argument("--output-json", default=None, metavar="FILE",
                        help="also write the results, machine and commit to FILE")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the low ids where vocabularies keep their special tokens.
    return [[rng.randrange(min(1000, vocab // 2), vocab) for _ in range(length)] for _ in range(n)]


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all prompts are done; collect step timings."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    starts, ttft, finished = {}, {}, {}
    overhead_at: dict[int, list[float]] = {}
    decode_steps = []
    prefill_steps = []  # (prompt tokens, step time) of every step that prefills
    # With asynchronous scheduling a step() call launches one step and waits for the one launched
    # by the call before: its time is that earlier step's.
    launched_before = None
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.outputs.parents) < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
            starts[f"b{i}"] = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        st = timed = engine.last_step
        if engine.async_scheduling:
            timed, launched_before = launched_before, st
        if timed is None:
            pass
        elif timed.num_seqs and timed.num_decodes == timed.num_seqs:  # a pure decode step
            overhead_at.setdefault(timed.num_seqs, []).append(st.overhead_time)
            decode_steps.append((timed.num_seqs, st.total_time, st.forward_time))
        elif timed.num_tokens > timed.num_decodes:  # on CUDA the GPU's time: the host's is the launch
            prefill_steps.append((timed.num_tokens - timed.num_decodes,
                                  st.total_time if st.device_time is None else st.device_time))
        for o in outs:
            ttft.setdefault(o.request_id, now - starts[o.request_id])
            if o.finished:
                finished[o.request_id] = now - starts[o.request_id]
    elapsed = time.perf_counter() - t0
    engine.check_no_leaks()
    n_out = len(prompts) * output_len
    full = [x for x in decode_steps if x[0] == max((d[0] for d in decode_steps), default=0)]
    return {
        "concurrency": concurrency, "num_prompts": len(prompts), "elapsed_s": elapsed,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_out + sum(map(len, prompts))) / elapsed,
        # tokens per second of the full-batch decode steps, and of the steps that prefill
        # (those may carry a few decode rows too: a conservative prefill figure)
        "decode_tok_s": (sum(n for n, _, _ in full) / sum(t for _, t, _ in full)) if full else None,
        "prefill_tok_s": (sum(n for n, _ in prefill_steps) / sum(t for _, t in prefill_steps))
        if prefill_steps else None,
        "ttft_p50_s": percentile(list(ttft.values()), 50), "ttft_p99_s": percentile(list(ttft.values()), 99),
        "e2e_p50_s": percentile(list(finished.values()), 50),
        "step_overhead_ms": {str(k): {"p50": 1e3 * percentile(v, 50), "p99": 1e3 * percentile(v, 99),
                                      "steps": len(v)} for k, v in sorted(overhead_at.items())},
    }


def run(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_args_from(args))
    engine.runner.time_steps = True  # prefill on the GPU's clock (a no-op on the CPU)
    vocab = engine.model_config.vocab_size
    if args.bench == "latency":
        sweep = [args.batch_size]
        num = lambda c: c  # noqa: E731
    else:
        sweep = [int(c) for c in str(args.max_concurrency).split(",")]
        num = lambda c: max(args.num_prompts, c)  # noqa: E731
    results = []
    for c in sweep:
        # Fresh prompts for every run: a prefix-cache hit would make prefill look free.
        for w in range(args.warmup):
            run_batch(engine, random_prompts(c, args.input_len, vocab, seed=-1 - w - 100 * c),
                      min(args.output_len, 8), c)
        iters = args.num_iters if args.bench == "latency" else 1
        runs = [run_batch(engine, random_prompts(num(c), args.input_len, vocab, seed=c + 10_000 * i),
                          args.output_len, c) for i in range(iters)]
        best = min(runs, key=lambda r: r["elapsed_s"])
        best["runs_elapsed_s"] = [r["elapsed_s"] for r in runs]
        results.append(best)
    base = results[0]["output_tok_s"]
    for r in results:
        r["speedup_vs_first"] = r["output_tok_s"] / base
        top = max(r["step_overhead_ms"], key=int, default=None)
        r["overhead_ms_p50_at_max"] = r["step_overhead_ms"][top]["p50"] if top else None
    if args.bench == "latency":  # one batch: what a user of it waits for
        print_table(results, ["concurrency", "ttft_p50_s", "prefill_tok_s", "decode_tok_s", "e2e_p50_s"])
    else:
        print_table(results, ["concurrency", "num_prompts", "elapsed_s", "output_tok_s", "decode_tok_s",
                              "prefill_tok_s", "ttft_p50_s", "speedup_vs_first", "overhead_ms_p50_at_max"])
    write_json(args.output_json, {**environment(), "benchmark": args.bench,
                                  "model": engine.args.model, "dtype": engine.dtype_name,
                                  "input_len": args.input_len, "output_len": args.output_len,
                                  "weight_bytes": engine.weight_bytes,
                                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                  "results": results})
    return 0
