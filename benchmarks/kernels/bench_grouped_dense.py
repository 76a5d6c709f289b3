"""Tile sweep of the grouped GEMV of dense experts (``kernels.triton.moe._grouped_dense_kernel``) at
Qwen3-30B-A3B's expert shapes in bf16, batch 1 (8 pairs): gate/up from one token, down from its 8 rows.

    python benchmarks/kernels/bench_grouped_dense.py BEST.json   # on a GPU; prints the fastest tiles
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton

from pocketllm.kernels.triton import moe

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(EXPERTS * 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    down = torch.randn(EXPERTS * HIDDEN, INTER, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randperm(EXPERTS, device="cuda")[:TOP_K]
    x1 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x8 = torch.randn(TOP_K, INTER, device="cuda", dtype=torch.bfloat16)

    def run():
        moe.grouped_dense_gemv_triton(x1, gate_up, 2 * INTER, ids, TOP_K)
        moe.grouped_dense_gemv_triton(x8, down, HIDDEN, ids, 1)

    before = dict(moe.DENSE_CONFIG)
    weight_bytes = TOP_K * (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    results = []
    for bn, bk, w in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (1, 2, 4, 8)):
        moe.DENSE_CONFIG = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
        try:
            results.append((triton.testing.do_bench(run, warmup=5, rep=30), moe.DENSE_CONFIG))
        except Exception as e:  # a tile that does not compile or fit
            print(moe.DENSE_CONFIG, type(e).__name__)
    results.sort(key=lambda r: r[0])
    print("current", [f"{t * 1e3:.1f} us" for t, c in results if c == before], before)
    for t, cfg in results[:8]:
        print(f"{t * 1e3:7.1f} us  {weight_bytes / t / 1e6:6.0f} GB/s  {cfg}")
    if len(sys.argv) > 1:
        json.dump(results[0][1], open(sys.argv[1], "w"))


if __name__ == "__main__":
    main()
