"""The CUDA C dense GEMV (``kernels/cuda/dense_gemv.cu``) against cuBLAS (``F.linear``) and, for a mixture of
experts' pairs, against the Triton grouped GEMV, bf16, at Qwen3-30B-A3B's and Llama-3.1-8B's decode shapes.
Weights are read from memory: enough copies (or, for the experts, other experts each run) that L2 holds
none of them, all multiplied in one CUDA graph (bench_cuda_gemv.timed: timed from Python, these small
products would time their launches). With --sweep, every (R, NT) tile of the kernel as well.

    python benchmarks/kernels/bench_dense_gemv.py [--sweep] [--output-json FILE]   # on a GPU
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cuda_gemv import timed, write_rows

from pocketllm.kernels.cuda import dense_gemv
from pocketllm.kernels.triton import moe

SHAPES = {  # name: (N, K)
    "qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096), "qwen3 router": (128, 2048), "qwen3 lm head": (151936, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate/up": (28672, 4096), "8b down": (4096, 14336),
}
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def each_tile(row: dict, tiles: list, call, inputs: int) -> tuple[float, str]:
    """Times ``call(i)`` over the inputs at the tile rule's tile (``cuda_us``) and at each swept one; the best."""
    real_tile = dense_gemv.tile
    for t in tiles:
        dense_gemv.tile = real_tile if t is None else (lambda *a, t=t: t)
        key = "cuda_us" if t is None else f"cuda_r{t[0]}_t{t[1]}_us"
        row[key] = timed(lambda: [call(i) for i in range(inputs)], inputs)
    dense_gemv.tile = real_tile
    return min((v, key) for key, v in row.items() if key.startswith("cuda"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    tiles = [None] + ([(r, nt) for r in (1, 2, 4, 8) for nt in (64, 96, 128, 256)] if args.sweep else [])
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, min(256, -(-(256 << 20) // nbytes)))  # past 256 MB, L2's 50 MB five times
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(copies)]
        for m in (1, 5):
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = dict(name=name, n=n, k=k, m=m, cublas_us=timed(lambda: [F.linear(x, w) for w in ws], copies))
            best = each_tile(row, tiles, lambda i: dense_gemv.linear(x, ws[i]), copies)
            err = (dense_gemv.linear(x, ws[0]).float() - F.linear(x.float(), ws[0].float())).abs().max()
            row["max_abs_err"] = float(err)
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
        row = dict(name=name, pairs=TOP_K, n=n, k=stacked.shape[1], triton_us=timed(
            lambda: [moe.grouped_dense_gemv_triton(x, stacked, n, p, x_div) for p in picks], len(picks)))
        best = each_tile(row, tiles, lambda i: dense_gemv.grouped(x, stacked, n, picks[i], x_div), len(picks))
        print(f"{name:22s} (8 pairs) | Triton {row['triton_us']:7.1f} us {nbytes / row['triton_us'] / 1e3:5.0f} GB/s "
              f"| CUDA C {row['cuda_us']:7.1f} us {nbytes / row['cuda_us'] / 1e3:5.0f} GB/s "
              f"(best {best[1]} {best[0]:7.1f})", flush=True)
        rows.append(row)
    write_rows(args.output_json, rows)


if __name__ == "__main__":
    main()
