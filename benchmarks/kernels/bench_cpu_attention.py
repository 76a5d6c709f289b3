"""The CPU decode attention kernel alone (layer_ops.decode_attention): microseconds a call for rows of
the default model's heads (9 query heads, 3 key heads, 64 wide) at several context lengths, best of
--rounds rounds of --calls calls. One line per shape, tagged with --label, so that two trees can be
alternated in one shell loop (run from a tree's root, the import and so the kernel are that tree's):

    for i in 1 2 3 4; do for t in /tmp/old /work/main; do (cd $t && python /work/main/benchmarks/kernels/bench_cpu_attention.py \
        --label $t); done; done
"""
from __future__ import annotations

import argparse
import time

import torch

from pocketllm.kernels.cpu import layer_ops

SHAPES = [(1, 300), (1, 1500), (1, 4000), (16, 1500)]  # (rows, context length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bs, hq, hkv, d = 16, 9, 3, 64
    for n, m in SHAPES:
        width = (m + bs - 1) // bs
        k_cache, v_cache = torch.randn(n * width, bs, hkv, d), torch.randn(n * width, bs, hkv, d)
        q = torch.randn(n, hq, d)
        tables = torch.arange(n * width).view(n, width)
        lens = torch.full((n,), m, dtype=torch.int64)

        def call():
            layer_ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, None, None)

        for _ in range(args.calls // 2):
            call()
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        print(f"{args.label} rows={n} context={m} {best * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    main()
