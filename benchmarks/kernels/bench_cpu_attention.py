"""The CPU decode attention kernel alone (layer_ops.decode_attention): microseconds a call for rows of
the default model's heads (9 query heads, 3 key heads, 64 wide) at several context lengths, best of
--rounds rounds of --calls calls. One line per shape, tagged with --label, so that two trees can be
alternated in one shell loop (PYTHONPATH names the tree whose package, and so whose kernel, is imported;
an editable install would otherwise give its own):

    for i in 1 2 3 4; do for t in /tmp/old /work/main; do (cd $t && PYTHONPATH=$t python \
        /work/main/benchmarks/kernels/bench_cpu_attention.py --label $t); done; done

--heads mla: DeepSeek-V2's latent attention instead (16 query heads over one latent head of 576: 512 latent
values and 64 rotary ones); --torch: beside the kernel, the torch path of layers/attention.py (the context's
blocks gathered with index_select, then scaled_dot_product_attention), in the same process.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pocketllm.kernels.cpu import layer_ops

SHAPES = [(1, 300), (1, 1500), (1, 4000), (16, 1500)]  # (rows, context length)
HEADS = {"default": (9, 3, 64), "mla": (16, 1, 576)}  # query heads, key heads, width


def best_of(call, rounds: int, calls: int) -> float:
    for _ in range(calls // 2):
        call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--heads", choices=sorted(HEADS), default="default")
    ap.add_argument("--torch", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bs, (hq, hkv, d) = 16, HEADS[args.heads]
    for n, m in SHAPES:
        width = (m + bs - 1) // bs
        k_cache, v_cache = torch.randn(n * width, bs, hkv, d), torch.randn(n * width, bs, hkv, d)
        q = torch.randn(n, hq, d)
        tables = torch.arange(n * width).view(n, width)
        lens = torch.full((n,), m, dtype=torch.int64)

        def kernel():
            return layer_ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, None, None)

        def gathered():
            flat = tables.reshape(-1)
            k = k_cache.index_select(0, flat).view(n, -1, hkv, d)[:, :m].transpose(1, 2)
            v = v_cache.index_select(0, flat).view(n, -1, hkv, d)[:, :m].transpose(1, 2)
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=d ** -0.5, enable_gqa=True).squeeze(2)

        line = f"{args.label} heads={args.heads} rows={n} context={m} {best_of(kernel, args.rounds, args.calls) * 1e6:.1f} us"
        if args.torch:
            assert torch.allclose(kernel(), gathered(), atol=1e-4)
            line += f" (torch {best_of(gathered, args.rounds, args.calls) * 1e6:.1f} us)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
