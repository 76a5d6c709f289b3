"""n-gram lookup's index (``speculative/ngram.py``) built over many long prompts at once, as the first lookup
of a 64-sequence step does: ``NgramIndex.extend`` against the plain loop it replaced (one slice, tuple and
dict store an n-gram), the same tables checked, best of --reps.

    python benchmarks/kernels/bench_ngram_index.py --out benchmarks/results/cpu-ngram-index.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pocketllm.bench.report import environment  # noqa: E402
from pocketllm.speculative.ngram import NgramIndex  # noqa: E402


def loop_extend(index: NgramIndex, tokens: list[int]) -> None:
    end = len(tokens) - 1
    for n, table in index.tables.items():
        for e in range(max(index.indexed, n), end + 1):
            table[tuple(tokens[e - n:e])] = e
    index.indexed = max(index.indexed, end + 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1246)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--ns", default="3,6", help="prompt_lookup_min,max")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    lo, hi = map(int, args.ns.split(","))
    rng = random.Random(0)
    seqs = [[rng.randrange(args.vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    times = {}
    for name, extend in (("loop", loop_extend), ("extend", NgramIndex.extend)):
        best = float("inf")
        for _ in range(args.reps):
            indexes = [NgramIndex(range(lo, hi + 1)) for _ in seqs]
            t = time.perf_counter()
            for index, s in zip(indexes, seqs):
                extend(index, s)
            best = min(best, time.perf_counter() - t)
        times[name] = (best, indexes)
    assert all(a.tables == b.tables for a, b in zip(times["loop"][1], times["extend"][1]))
    row = {"prompts": args.prompts, "tokens": args.tokens, "ns": [lo, hi],
           "loop_ms": round(times["loop"][0] * 1e3, 2), "extend_ms": round(times["extend"][0] * 1e3, 2)}
    row["speedup"] = round(row["loop_ms"] / row["extend_ms"], 2)
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**environment(), "rows": [row]}, f, indent=1)


if __name__ == "__main__":
    main()
