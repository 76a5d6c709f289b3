"""How long a first start waits for the CPU kernels to build: two source trees' builds timed alternately, each
in a fresh cache directory (a new process each, as a first `pocketllm serve` builds them), wall and CPU time.

    python benchmarks/tools/cpu_kernel_build.py BEFORE_TREE AFTER_TREE --rounds 3
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from pocketllm.bench.report import environment

BUILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("build", sys.argv[1] + "/pocketllm/kernels/cpu/build.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert module.load_cpu_kernels() is not None, "the build failed"
"""


def build_seconds(tree: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one build of ``tree``'s kernels into an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, tree], check=True, env={**os.environ, "POCKETLLM_CACHE": cache})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = environment()
    print(f"# {env['machine']['cpu']}, {os.cpu_count()} cores, commit {env['commit']}{' (dirty)' if env['dirty'] else ''}, "
          f"{env['date']}; {env['command']}")
    runs = {"before": [], "after": []}
    for i in range(args.rounds):
        for name in runs:
            wall, cpu = build_seconds(getattr(args, name))
            runs[name].append(wall)
            print(f"round {i + 1} {name:6}: {wall:5.1f} s wall, {cpu:5.1f} s CPU")
    med = {name: sorted(t)[len(t) // 2] for name, t in runs.items()}
    print(f"median wall: before {med['before']:.1f} s, after {med['after']:.1f} s -> "
          f"{med['before'] / med['after']:.2f}x")


if __name__ == "__main__":
    main()
