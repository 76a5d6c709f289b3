"""Time to open a GGUF file (parse its metadata and tensor table): gguf's GGUFReader against
pocketllm.gguf_file.GGUFFile, alternated, each the best of --reps.

    python benchmarks/tools/gguf_open_time.py FILE.gguf [--reps 3] [--output-json PATH]
"""
from __future__ import annotations

import argparse
import time

from gguf import GGUFReader

from pocketllm.bench.report import environment, write_json
from pocketllm.gguf_file import GGUFFile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"GGUFReader": [], "GGUFFile": []}
    for _ in range(args.reps):
        for name, cls in (("GGUFReader", GGUFReader), ("GGUFFile", GGUFFile)):
            t0 = time.perf_counter()
            reader = cls(args.model)
            times[name].append(time.perf_counter() - t0)
            del reader
    best = {k: min(v) for k, v in times.items()}
    for k, v in best.items():
        print(f"{k:>10}: {v:.2f} s (best of {args.reps})")
    print(f"{'speedup':>10}: {best['GGUFReader'] / best['GGUFFile']:.2f}x")
    write_json(args.output_json, {**environment(), "model": args.model, "seconds": times, "best_s": best,
                                  "speedup": best["GGUFReader"] / best["GGUFFile"]})


if __name__ == "__main__":
    main()
