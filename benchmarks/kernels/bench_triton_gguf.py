"""Time the Triton GGUF matmul (pocketllm/kernels/triton/gguf.py) against a bf16 torch.matmul of the
same shape, on a CUDA GPU.

    python benchmarks/kernels/bench_triton_gguf.py                       # Q4_K Q6_K Q8_0, M = 1 and 512
    python benchmarks/kernels/bench_triton_gguf.py --ms 1,2,4,8,16,32,64,128,256,512 --regimes   # crossovers
    python benchmarks/kernels/bench_triton_gguf.py --types Q4_K,IQ2_XXS --ms 1,2 --regimes gemv,gemv_q8
    python benchmarks/kernels/bench_triton_gguf.py --sweep               # tile configs of each regime's kernel

Weights are random GGUF blocks with small fp16 scales (the dummy-GGUF generator), shapes (N, K) of
Llama-3.1-8B: 4096x4096 (q/o), 14336x4096 (gate, up), 4096x14336 (down), 1024x4096 (k/v).  Times
are CUDA-graph replays (triton.testing.do_bench_cudagraph): the GPU time, without Python's launch
overhead (the engine replays decode steps as graphs too); "host us" is one eager call, Python
included.  GB/s counts the bytes a call must move: weights (GGUF size, or bf16 for torch) plus
activations in and out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch
import triton
from gguf import GGMLQuantizationType as T

from pocketllm.core.gguf_types import row_nbytes
from pocketllm.kernels import dispatch
from pocketllm.kernels.triton import gguf as kg
from pocketllm.kernels.triton import gguf_mma as mma
from pocketllm.kernels.triton import gguf_q8 as q8
from pocketllm.loaders.dummy_gguf import _random_blocks

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


def bench_us(fn, rep: int = 50) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def host_us(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def weight(qtype, n, k):
    raw = torch.from_numpy(_random_blocks(np.random.default_rng(0), qtype, (n, k), 0.02))
    return kg.pack_gguf(raw, qtype, k, "cuda")


def row(qtype, n, k, m, packed, regime="auto"):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q_bytes = n * row_nbytes(qtype, k) + 2 * m * (k + n)
    d_bytes = 2 * n * k + 2 * m * (k + n)
    tq = bench_us(lambda: kg.gguf_matmul(x, packed, qtype, k, packed=True, regime=regime))
    td = bench_us(lambda: x @ w16.T)
    hq = host_us(lambda: kg.gguf_matmul(x, packed, qtype, k, packed=True, regime=regime))
    return tq, td, q_bytes / tq / 1e3, d_bytes / td / 1e3, hq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--ms", default="1,512")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    ap.add_argument("--regimes", nargs="?", const="gemv,gemv_q8,mma,dequant", default="auto",
                    help="time these regimes at each M (no value: every one; default: auto)")
    ap.add_argument("--sweep", action="store_true", help="tile configs of each regime's kernel (SWEEP_GRIDS)")
    ap.add_argument("--sweep-regimes", default=",".join(SWEEP_GRIDS), help="with --sweep: which regimes")
    ap.add_argument("--sweep-m", type=int, default=None, help="with --sweep: this M instead of each regime's")
    ap.add_argument("--sweep-grid", default=None,
                    help='with --sweep: this grid (JSON, e.g. {"PROGRAMS_PER_SM": [1, 2, 4]}) instead of SWEEP_GRIDS')
    ap.add_argument("--warm", default=None, help="I/N: with --sweep, only compile the I-th of N shares of the configs")
    ap.add_argument("--no-splits", action="store_true", help="skip the split-K sweep (Q4_K, Q6_K at M=1)")
    ap.add_argument("--peak", type=float, default=4800.0, help="the GPU's memory bandwidth, GB/s (H200: 4800)")
    args = ap.parse_args()
    types = [T[t] for t in args.types.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# GEMV_MAX_M={dispatch.GEMV_MAX_M}\n# GEMV_CONFIG={kg.GEMV_CONFIG}\n"
          f"# MMA_CONFIG={kg.MMA_CONFIG} MMA_MAX_M={dispatch.MMA_MAX_M}")

    if args.sweep:
        if args.sweep_grid:
            for regime in args.sweep_regimes.split(","):
                m, cfg, _ = SWEEP_GRIDS[regime]
                SWEEP_GRIDS[regime] = (m, cfg, json.loads(args.sweep_grid))
        sweep(types, shapes, args.peak, tuple(int(v) for v in args.warm.split("/")) if args.warm else None,
              args.sweep_regimes.split(","), args.sweep_m)
        return
    regimes = args.regimes.split(",")
    print(f"{'type':6s} {'N x K':>11s} {'M':>4s} {'regime':>7s} {'gguf us':>8s} {'bf16 us':>8s} {'speedup':>7s} "
          f"{'gguf GB/s':>9s} {'%peak':>5s} {'bf16 GB/s':>9s} {'host us':>7s}")
    for qtype in types:
        for n, k in shapes:
            packed = weight(qtype, n, k)
            for m in ms:
                for regime in regimes:
                    if (regime.startswith("gemv") and m > 16 or regime == "gemv_q8" and qtype not in q8.Q8_TYPES
                            or regime == "mma" and qtype not in mma.MMA_TYPES):
                        continue
                    tq, td, gq, gd, hq = row(qtype, n, k, m, packed, regime)
                    print(f"{qtype.name:6s} {n:>5d}x{k:<5d} {m:>4d} {regime:>7s} {tq:8.1f} {td:8.1f} {td / tq:7.2f} "
                          f"{gq:9.0f} {100 * gq / args.peak:5.0f} {gd:9.0f} {hq:7.0f}", flush=True)
    if not args.no_splits:
        split_sweep(args.peak)


def split_sweep(peak):
    """M=1 gemv: time of each K split count (and the default's choice), Q4_K and Q6_K."""
    print("# split-K sweep, gemv M=1: us (GB/s) per split count; * = the default's choice")
    for qtype in (T.Q4_K, T.Q6_K):
        for n, k in ((4096, 4096), (14336, 4096)):
            packed = weight(qtype, n, k)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            cfg = kg.kernel_config("gemv", qtype)
            nb = k // kg.block_size(qtype)
            bpi = kg._blocks_per_step(qtype, cfg["BLOCK_K"])
            chosen = kg._split_k(triton.cdiv(n, cfg["BLOCK_N"]), nb, bpi, x.device, cfg["PROGRAMS_PER_SM"])
            nbytes = n * row_nbytes(qtype, k)
            cells = []
            for sp in (1, 2, 3, 4, 6, 8, 16):
                t = bench_us(lambda sp=sp: kg.gguf_matmul(x, packed, qtype, k, packed=True, regime="gemv", split_k=sp))
                cells.append(f"{sp}{'*' if sp == chosen else ''}:{t:.1f}({nbytes / t / 1e3:.0f})")
            print(f"{qtype.name:6s} {n:>5d}x{k:<5d} " + "  ".join(cells), flush=True)


SWEEP_GRIDS = {  # regime: (M, the config it edits, the grid)
    "gemv_q8": (1, q8.GEMV_Q8_CONFIG, dict(BLOCK_N=[1, 2, 4, 8], BLOCK_K=[1024, 2048, 4096],
                                                     num_warps=[2, 4, 8])),
    "gemv": (1, kg.GEMV_CONFIG, dict(BLOCK_N=[1, 2, 4, 8], BLOCK_K=[512, 1024, 2048, 4096], num_warps=[1, 2, 4],
                                     num_stages=[1])),
    "mma": (64, kg.MMA_CONFIG, dict(BLOCK_N=[64, 128, 256], BLOCK_K=[64, 128, 256], num_warps=[4, 8],
                                    num_stages=[1, 2])),
    "dequant": (64, kg.DEQUANT_CONFIG, dict(BLOCK_N=[1, 2, 4, 8, 16], BLOCK_K=[256, 1024, 2048], num_warps=[1, 2, 4])),
}


def sweep(types, shapes, peak, warm: tuple[int, int] | None = None, regimes=tuple(SWEEP_GRIDS), m_over=None):
    """Time every tile config of each regime's grid.  ``warm=(i, n)``: only compile (run once) the
    i-th of n shares of the configs, no timing: several processes fill Triton's cache at once, and
    the timing run then compiles nothing."""
    index = 0
    for regime, (m, cfg, grid) in SWEEP_GRIDS.items():
        if regime not in regimes:
            continue
        m = m_over or m
        default = dict(cfg)
        for qtype in types:
            if regime == "gemv_q8" and qtype not in q8.Q8_TYPES or regime == "mma" and qtype not in mma.MMA_TYPES:
                continue
            for n, k in shapes:
                packed = weight(qtype, n, k)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                nbytes = n * row_nbytes(qtype, k)
                results = []
                for values in itertools.product(*grid.values()):
                    index += 1
                    if warm and index % warm[1] != warm[0]:
                        continue
                    cfg.update(zip(grid, values))

                    def call(x=x, w=packed, qt=qtype, k=k, r=regime):
                        return kg.gguf_matmul(x, w, qt, k, packed=True, regime=r)

                    try:
                        t = call() if warm else bench_us(call, rep=20)
                    except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the config
                        if not warm:
                            print(f"  {regime} {dict(zip(grid, values))}: {type(e).__name__}")
                        continue
                    finally:
                        cfg.clear()
                        cfg.update(default)
                    results.append((t, dict(zip(grid, values))))
                if warm:
                    continue
                results.sort(key=lambda r: r[0])
                t_def = bench_us(call)
                print(f"{regime} M={m} {qtype.name} {n}x{k}: default {t_def:.1f} us "
                      f"({nbytes / t_def / 1e3 / peak * 100:.0f}% peak); fastest first:", flush=True)
                for t, c in results:
                    print(f"    {t:7.1f} us {nbytes / t / 1e3:6.0f} GB/s  {c}", flush=True)


if __name__ == "__main__":
    main()
