"""The CUDA C dense GEMV (``kernels/cuda/dense_gemv.cu``) against cuBLAS (``F.linear``) and, for a mixture of
experts' pairs, against the Triton grouped GEMV, bf16, at Qwen3-30B-A3B's and Llama-3.1-8B's decode shapes.
Weights are read from memory: enough copies (or, for the experts, other experts each run) that L2 holds
none of them. With --sweep, every (R, NT) tile of the kernel as well.

    python benchmarks/bench_dense_gemv.py [--sweep] [--output-json FILE]   # on a GPU
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pocketllm.kernels.cuda import dense_gemv
from pocketllm.kernels.triton import moe

SHAPES = {  # name: (N, K)
    "qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096), "qwen3 router": (128, 2048), "qwen3 lm head": (151936, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate/up": (28672, 4096), "8b down": (4096, 14336),
}
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def timed(fn, copies: int) -> float:
    """Microseconds a call on the GPU: calls cycling over ``copies`` inputs, replayed from a CUDA graph
    as the decode step runs them (timed from Python, these small products would time their launches)."""
    calls = max(copies, 64)
    for i in range(min(copies, 3)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    tiles = [None] + ([(r, nt) for r in (1, 2, 4, 8) for nt in (64, 96, 128, 256)] if args.sweep else [])
    real_tile = dense_gemv.tile
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(copies)]
        for m in (1, 5):
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = dict(name=name, n=n, k=k, m=m, cublas_us=timed(lambda i: F.linear(x, ws[i]), copies))
            for t in tiles:
                dense_gemv.tile = real_tile if t is None else (lambda *a, t=t: t)
                key = "cuda_us" if t is None else f"cuda_r{t[0]}_t{t[1]}_us"
                row[key] = timed(lambda i: dense_gemv.linear(x, ws[i]), copies)
            dense_gemv.tile = real_tile
            err = (dense_gemv.linear(x, ws[0]).float() - F.linear(x.float(), ws[0].float())).abs().max()
            row["max_abs_err"] = float(err)
            best = min((v, key) for key, v in row.items() if key.startswith("cuda"))
            print(f"{name:14s} {n:6d}x{k:<5d} M={m} | cuBLAS {row['cublas_us']:7.1f} us "
                  f"{nbytes / row['cublas_us'] / 1e3:5.0f} GB/s | CUDA C {row['cuda_us']:7.1f} us "
                  f"{nbytes / row['cuda_us'] / 1e3:5.0f} GB/s (best {best[1]} {best[0]:7.1f}) | err {err:.1e}", flush=True)
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    # the experts of one Qwen3-30B-A3B layer at batch 1: gate/up from one token, down from its 8 rows
    gate_up = torch.randn(EXPERTS * 2 * INTER, HIDDEN, device=dev, dtype=dt)
    down = torch.randn(EXPERTS * HIDDEN, INTER, device=dev, dtype=dt)
    picks = [torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in range(EXPERTS)]
    x1 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    x8 = torch.randn(TOP_K, INTER, device=dev, dtype=dt)
    for name, x, stacked, n, x_div in (("qwen3 experts gate/up", x1, gate_up, 2 * INTER, TOP_K),
                                       ("qwen3 experts down", x8, down, HIDDEN, 1)):
        nbytes = TOP_K * n * stacked.shape[1] * 2
        row = dict(name=name, pairs=TOP_K, n=n, k=stacked.shape[1],
                   triton_us=timed(lambda i: moe.grouped_dense_gemv_triton(x, stacked, n, picks[i], x_div), len(picks)))
        for t in tiles:
            dense_gemv.tile = real_tile if t is None else (lambda *a, t=t: t)
            key = "cuda_us" if t is None else f"cuda_r{t[0]}_t{t[1]}_us"
            row[key] = timed(lambda i: dense_gemv.grouped(x, stacked, n, picks[i], x_div), len(picks))
        dense_gemv.tile = real_tile
        best = min((v, key) for key, v in row.items() if key.startswith("cuda"))
        print(f"{name:22s} (8 pairs) | Triton {row['triton_us']:7.1f} us {nbytes / row['triton_us'] / 1e3:5.0f} GB/s "
              f"| CUDA C {row['cuda_us']:7.1f} us {nbytes / row['cuda_us'] / 1e3:5.0f} GB/s "
              f"(best {best[1]} {best[0]:7.1f})", flush=True)
        rows.append(row)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
