"""Two source trees' CPU kernel builds loaded in one process and timed alternately on the same
weights, so that a noisy machine's drift falls on both: the 8-bit GGUF matmul at the given types,
decode shapes of a 1.5B model (1 and 4 activation rows), the median over 5 rounds of each build's
best of 10 calls. The two builds' outputs are checked equal first.

    python benchmarks/ab_cpu_kernels.py BEFORE_TREE AFTER_TREE IQ2_S IQ1_S ...
"""
from __future__ import annotations

import importlib.util
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pocketllm.bench.report import environment
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.loaders.dummy_gguf import _random_blocks

SHAPES = [(8960, 1536, 1), (1536, 8960, 1), (8960, 1536, 4)]


def kernels_of(tree: str, name: str):
    spec = importlib.util.spec_from_file_location(name, f"{tree}/pocketllm/kernels/cpu/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_cpu_kernels()


def main() -> None:
    before, after, *types = sys.argv[1:]
    torch.set_num_threads(2)
    env = environment()
    print(f"# {env['machine']['cpu']}, {env['date']}, 2 threads; before: {before}, after: {after}")
    libs = {"before": kernels_of(before, "kernels_before"), "after": kernels_of(after, "kernels_after")}
    rng = np.random.default_rng(0)
    for qtype in map(T.__getitem__, types):
        for n, k, b in SHAPES:
            raw = torch.from_numpy(_random_blocks(rng, qtype, (n, k), 0.05)).view(torch.uint8).reshape(n, -1)
            rows, x = gguf_ops.row_pointers([raw.contiguous()]), torch.randn(b, k)
            outs = [gguf_ops.gemm(x, rows, qtype, int8=1, lib=lib) for lib in libs.values()]
            assert torch.equal(*outs), "the two builds disagree"
            times = {name: [] for name in libs}
            for _ in range(5):
                for name, lib in libs.items():
                    best = float("inf")
                    for _ in range(10):
                        t0 = time.perf_counter()
                        gguf_ops.gemm(x, rows, qtype, int8=1, lib=lib)
                        best = min(best, time.perf_counter() - t0)
                    times[name].append(best * 1e3)
            med = {name: sorted(t)[2] for name, t in times.items()}
            rounds = " ".join(f"{a:.2f}/{c:.2f}" for a, c in zip(times["before"], times["after"]))
            print(f"{qtype.name:6} {n}x{k} rows {b}: before {med['before']:.3f} ms, after {med['after']:.3f} ms "
                  f"-> {med['before'] / med['after']:.2f}x; rounds (before/after) {rounds}")


if __name__ == "__main__":
    main()
