"""Server vs offline engine, interleaved: the same prompts at the same concurrency, alternating which
side runs first, many short rounds, so that the machine's drift hits both sides alike.

A round at concurrency c runs `--waves` x c fresh prompts (128 in / 64 out by default) through the
offline engine in this process (`pocketllm bench throughput`'s loop) and through a running
`pocketllm serve` (`pocketllm bench serve`'s client), one right after the other. Per round it
records both sides' output throughput (the ratio is the issue's throughput figure), their median
end-to-end latency per request (client-side for the server, add -> finished for the engine; at
c = 1 its ratio is the single-stream latency figure) and TTFT. Queue time is the server's
`request_queue_time_seconds` histogram (HTTP arrival -> first scheduled), summed over all rounds
at that concurrency before its p99 is taken.

The machine is shared: if another process used the CPU while a round ran (its CPU time is read
from /proc), the round is measured again with new prompts.

    python benchmarks/suites/serve_vs_offline.py [MODEL] --output-json benchmarks/results/cpu-serve-vs-offline.json
    python benchmarks/suites/serve_vs_offline.py --engine-flags "--max-num-batched-tokens 256"   # both sides
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time

import httpx


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> set[int]:
    """A process and its descendants (the server, and any process the server starts)."""
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split() if int(c) not in pids]
        except OSError:  # it has just exited
            pass
    return pids


def cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


class Foreign:
    """CPU time used by processes other than this one and its children while a measurement ran."""

    def __enter__(self) -> Foreign:
        self.pids = process_tree(os.getpid())
        self.t0, self.busy0, self.own0 = time.monotonic(), busy_seconds(), cpu_seconds(self.pids)
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.monotonic() - self.t0
        self.seconds = busy_seconds() - self.busy0 - (cpu_seconds(self.pids) - self.own0)

    @property
    def disturbed(self) -> bool:
        return self.seconds > 0.05 + 0.03 * self.wall


def wait_quiet(max_wait: float = 1800.0) -> float:
    """Wait until the machine has been idle for 3 s (under 10% of one core busy); returns the wait."""
    t0 = time.monotonic()
    while True:
        b0 = busy_seconds()
        time.sleep(3)
        if busy_seconds() - b0 < 0.3 or time.monotonic() - t0 > max_wait:
            return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--waves", type=int, default=2, help="prompts per round = waves x concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--engine-flags", default="", help="engine flags for both sides, e.g. '--num-threads 1'")
    ap.add_argument("--server-flags", default="", help="extra flags for `pocketllm serve` only")
    ap.add_argument("--max-retries", type=int, default=6,
                    help="times a round is measured again when another process used the CPU")
    ap.add_argument("--note", default=None, help="recorded with the results, e.g. what the tree holds beyond its commit")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    from pocketllm.bench.offline import run_batch
    from pocketllm.bench.report import environment, print_table, write_json
    from pocketllm.bench.serve import _QUEUE_METRIC, histogram_buckets, histogram_quantile, run_level
    from pocketllm.cli.args import add_engine_args, engine_args_from
    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.pull import pull_default_model

    model = args.model or str(pull_default_model())
    engine_flags = ["--max-model-len", str(args.max_model_len), *shlex.split(args.engine_flags)]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pocketllm.cli.main", "serve", model, "--port", str(port),
                               *engine_flags, *shlex.split(args.server_flags)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    levels = [int(x) for x in args.concurrency.split(",")]
    rounds: list[dict] = []
    queue: dict[int, tuple[dict, dict]] = {}  # concurrency -> (bucket counts summed over its rounds: before, after)
    try:
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        engine = LLMEngine(engine_args_from(parser.parse_args([model, *engine_flags])))
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.5)
        served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        async def served_level(prompts, c):
            async with httpx.AsyncClient(base_url=base, timeout=None) as client:
                before = histogram_buckets((await client.get("/metrics")).text, _QUEUE_METRIC)
                level = await run_level(client, served, prompts, args.output_len, c)
                after = histogram_buckets((await client.get("/metrics")).text, _QUEUE_METRIC)
                return level, before, after

        def measure(side: str, prompts: list[list[int]], c: int) -> dict:
            if side == "offline":
                res = run_batch(engine, prompts, args.output_len, c)
                return {"offline": res["output_tok_s"], "offline_e2e_p50_s": res["e2e_p50_s"],
                        "offline_ttft_p50_s": res["ttft_p50_s"]}
            level, before, after = asyncio.run(served_level(prompts, c))
            assert level["errors"] == 0, level["first_error"]
            return {"server": level["output_tok_s"], "server_e2e_p50_s": level["e2e_p50_ms"] / 1e3,
                    "server_ttft_p50_s": level["ttft_p50_ms"] / 1e3, "queue_p99_ms": level["queue_p99_ms"],
                    "_queue": (before, after)}

        rng = random.Random(0)
        for r in range(args.rounds):
            for c in levels:
                order = ("offline", "server") if r % 2 == 0 else ("server", "offline")
                for attempt in range(args.max_retries + 1):
                    waited = wait_quiet()
                    # Fresh prompts for each measurement: neither side gets prefix-cache hits from earlier ones.
                    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)]
                               for _ in range(args.waves * c)]
                    row = {"round": r, "concurrency": c, "order": list(order), "attempt": attempt,
                           "waited_s": round(waited, 1)}
                    disturbed = False
                    for side in order:
                        with Foreign() as foreign:
                            row.update(measure(side, prompts, c))
                        row[f"{side}_foreign_cpu_s"] = round(foreign.seconds, 2)
                        disturbed |= foreign.disturbed
                    if not disturbed:
                        break
                    print(f"another process used the CPU during round {r} at c={c}; measuring again", flush=True)
                before, after = row.pop("_queue")
                total = queue.setdefault(c, ({}, {}))
                for acc, counts in zip(total, (before, after)):
                    for le, n in counts.items():
                        acc[le] = acc.get(le, 0.0) + n
                row.update(disturbed=disturbed, ratio=row["server"] / row["offline"],
                           latency_ratio=row["server_e2e_p50_s"] / row["offline_e2e_p50_s"])
                rounds.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    summary = []
    for c in levels:
        rows = [x for x in rounds if x["concurrency"] == c]
        ratios = sorted(x["ratio"] for x in rows)
        q99 = histogram_quantile(0.99, *queue[c])
        summary.append({
            "concurrency": c, "rounds": len(rows), "disturbed_rounds": sum(x["disturbed"] for x in rows),
            "offline_tok_s": statistics.median(x["offline"] for x in rows),
            "server_tok_s": statistics.median(x["server"] for x in rows),
            "median_ratio": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3,
            "median_latency_ratio": statistics.median(x["latency_ratio"] for x in rows),
            "server_ttft_p50_s": statistics.median(x["server_ttft_p50_s"] for x in rows),
            "offline_ttft_p50_s": statistics.median(x["offline_ttft_p50_s"] for x in rows),
            "queue_p99_ms": None if q99 is None else 1e3 * q99,
        })
    print_table(summary, ["concurrency", "rounds", "offline_tok_s", "server_tok_s", "median_ratio",
                          "median_latency_ratio", "queue_p99_ms"])
    write_json(args.output_json, {**environment(), "note": args.note, "model": model, "input_len": args.input_len,
                                  "output_len": args.output_len, "waves": args.waves,
                                  "engine_flags": args.engine_flags, "server_flags": args.server_flags,
                                  "summary": summary, "rounds": rounds})


if __name__ == "__main__":
    main()
