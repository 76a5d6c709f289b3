"""DeepSeek's absorbed heads on the CPU at V2-Lite's shapes (16 heads; W_UK 128 x 512, W_UV^T 512 x 128), one
decode row: layer_ops.heads_matvec_bf16 on bfloat16 weights against torch.bmm on float32 ones, 27 layers'
weights in turn (so that caches hold few of them), milliseconds for the 27, best of --rounds.

    python benchmarks/kernels/bench_cpu_heads.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from pocketllm.kernels.cpu import layer_ops

SHAPES = {"W_UK": (128, 512), "W_UV^T": (512, 128)}  # (K, N) a head
HEADS, LAYERS = 16, 27


def best_of(call, rounds: int) -> float:
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, (k, n) in SHAPES.items():
        w32 = [torch.randn(HEADS, k, n) for _ in range(LAYERS)]
        w16 = [w.to(torch.bfloat16) for w in w32]
        x = torch.randn(HEADS, 1, k)
        torch_ms = best_of(lambda: [torch.bmm(x, w) for w in w32], args.rounds) * 1e3
        c_ms = best_of(lambda: [layer_ops.heads_matvec_bf16(x, w) for w in w16], args.rounds) * 1e3
        print(f"{name} ({k} x {n} a head): torch float32 {torch_ms:.2f} ms, C bfloat16 {c_ms:.2f} ms "
              f"for {LAYERS} layers", flush=True)


if __name__ == "__main__":
    main()
