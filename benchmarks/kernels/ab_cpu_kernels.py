"""Two source trees' CPU kernel builds loaded in one process and timed alternately on the same
weights, so that a noisy machine's drift falls on both: the 8-bit GGUF matmul at the given types,
shapes of a 1.5B model (1 and 4 activation rows, and 64 as in a prefill), the median over 5 rounds of
each build's best of 10 calls. The two builds' outputs are checked equal first.

With --cold, one activation row on weights read from memory, as a decode step reads them: the matrix
is copied until the copies pass 600 MB (far past the caches) and each round multiplies by every copy
in turn (the median of 5 rounds' mean); the 1.5B model's shapes and its 151936-row output layer.
With --x8, the interleaved kernels (each build's own repacking), hot or cold.

    python benchmarks/kernels/ab_cpu_kernels.py BEFORE_TREE AFTER_TREE IQ2_S IQ1_S ...
    python benchmarks/kernels/ab_cpu_kernels.py BEFORE_TREE AFTER_TREE Q6_K Q4_K --cold --x8
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pocketllm.bench.report import environment
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.loaders.dummy_gguf import _random_blocks

SHAPES = [(8960, 1536, 1), (1536, 8960, 1), (8960, 1536, 4), (1536, 8960, 64)]
COLD_SHAPES = [(17920, 1536), (1536, 8960), (1536, 1536), (151936, 1536)]
COLD_BYTES = 600e6


def kernels_of(tree: str, name: str):
    spec = importlib.util.spec_from_file_location(name, f"{tree}/pocketllm/kernels/cpu/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_cpu_kernels()


def prepared(libs: dict, qtype: T, rows: list, x: torch.Tensor, n: int, k: int, x8: bool):
    """(each build's weights, one a copy of the matrix: its own repacking with x8; the call that multiplies x by
    one), the builds' outputs checked equal; None where a build has no interleaved layout for the type."""
    if x8:
        weights = {name: [gguf_ops.repack_x8(r, qtype, k, lib=lib) for r in rows] for name, lib in libs.items()}
        if any(w[0] is None for w in weights.values()):
            print(f"{qtype.name:6} has no interleaved layout in this build")
            return None
        call = lambda w, lib: gguf_ops.gemm_x8(x, w, n, qtype, lib=lib)  # noqa: E731
    else:
        weights = {name: rows for name in libs}
        call = lambda w, lib: gguf_ops.gemm(x, w, qtype, int8=1, lib=lib)  # noqa: E731
    outs = [call(weights[name][0], lib) for name, lib in libs.items()]
    assert torch.equal(*outs), "the two builds disagree"
    return weights, call


def summary(times: dict, digits: int) -> tuple[dict, str]:
    """Each build's median of its rounds, and the rounds side by side."""
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    rounds = " ".join(f"{a:.{digits}f}/{c:.{digits}f}" for a, c in zip(times["before"], times["after"]))
    return med, rounds


def hot(libs: dict, qtype: T, rng: np.random.Generator, x8: bool) -> None:
    for n, k, b in SHAPES:
        raw = torch.from_numpy(_random_blocks(rng, qtype, (n, k), 0.05)).view(torch.uint8).reshape(n, -1)
        ready = prepared(libs, qtype, [gguf_ops.row_pointers([raw.contiguous()])], torch.randn(b, k), n, k, x8)
        if ready is None:
            return
        weights, call = ready
        times = {name: [] for name in libs}
        for _ in range(5):
            for name, lib in libs.items():
                best = float("inf")
                for _ in range(10):
                    t0 = time.perf_counter()
                    call(weights[name][0], lib)
                    best = min(best, time.perf_counter() - t0)
                times[name].append(best * 1e3)
        med, rounds = summary(times, 2)
        print(f"{qtype.name:6} {n}x{k} rows {b}{' x8' if x8 else ''}: before {med['before']:.3f} ms, after "
              f"{med['after']:.3f} ms -> {med['before'] / med['after']:.2f}x; rounds (before/after) {rounds}")


def cold(libs: dict, qtype: T, rng: np.random.Generator, x8: bool) -> None:
    for n, k in COLD_SHAPES:
        raw = torch.from_numpy(_random_blocks(rng, qtype, (n, k), 0.05)).view(torch.uint8).reshape(n, -1)
        copies = [raw.clone() for _ in range(max(2, int(COLD_BYTES // raw.numel())))]  # kept: rows point into them
        ready = prepared(libs, qtype, [gguf_ops.row_pointers([c]) for c in copies], torch.randn(1, k), n, k, x8)
        if ready is None:
            return
        weights, call = ready
        times = {name: [] for name in libs}
        for _ in range(5):
            for name, lib in libs.items():
                t0 = time.perf_counter()
                for w in weights[name]:
                    call(w, lib)
                times[name].append((time.perf_counter() - t0) / len(copies) * 1e3)
        med, rounds = summary(times, 3)
        gbs = {name: raw.numel() / med[name] / 1e6 for name in libs}
        print(f"{qtype.name:6} {n}x{k} {'x8' if x8 else 'per row'}, cold: before {med['before']:.3f} ms "
              f"({gbs['before']:.1f} GB/s), after {med['after']:.3f} ms ({gbs['after']:.1f} GB/s) "
              f"-> {med['before'] / med['after']:.2f}x; rounds (before/after) {rounds}", flush=True)
        del copies, weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("types", nargs="+")
    ap.add_argument("--cold", action="store_true", help="one row, weights read from memory")
    ap.add_argument("--x8", action="store_true", help="the interleaved kernels")
    args = ap.parse_args()
    torch.set_num_threads(2)
    env = environment()
    print(f"# {env['machine']['cpu']}, {env['date']}, 2 threads; before: {args.before}, after: {args.after}; "
          f"{env['command']}")
    libs = {"before": kernels_of(args.before, "kernels_before"), "after": kernels_of(args.after, "kernels_after")}
    rng = np.random.default_rng(0)
    for qtype in map(T.__getitem__, args.types):
        if args.cold:
            cold(libs, qtype, rng, args.x8)
        else:
            hot(libs, qtype, rng, args.x8)


if __name__ == "__main__":
    main()
