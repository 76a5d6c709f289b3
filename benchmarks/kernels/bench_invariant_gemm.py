"""The row-invariant GEMM (pocketllm/kernels/triton/invariant_gemm.py) against cuBLAS (F.linear) at the 8B
shapes of the layers that take it (o: 4096x4096, down: 4096x14336), bf16, on a CUDA GPU: time per call
(weights rotated past 400 MB, one CUDA graph over them, as bench_cuda_gemv.py), and whether a row's bits
at M rows equal its bits at 64 rows (cuBLAS changes its kernel with M; the invariant GEMM must not).

    python benchmarks/kernels/bench_invariant_gemm.py --rows 49,64,80,128,192,320 --output-json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_cuda_gemv import timed, write_rows

from pocketllm.kernels.triton.invariant_gemm import invariant_linear


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="49,64,80,128,192,320")
    ap.add_argument("--shapes", default="4096x4096,4096x14336")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    out = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ws = [w0] + [w0.clone() for _ in range(max(1, min(32, -(-400_000_000 // (2 * n * k)))) - 1)]
        x_all = torch.randn(max(map(int, args.rows.split(","))), k, device="cuda", dtype=torch.bfloat16)
        base = {name: fn(x_all[:64], w0) for name, fn in (("cublas", F.linear), ("invariant", invariant_linear))}
        for m in map(int, args.rows.split(",")):
            x = x_all[:m]
            row = dict(n=n, k=k, m=m)
            for name, fn in (("cublas", F.linear), ("invariant", invariant_linear)):
                row[f"{name}_us"] = timed(lambda: [fn(x, w) for w in ws], len(ws))
                y = fn(x, w0)
                top = min(m, 64)
                row[f"{name}_same_bits_as_64_rows"] = bool(torch.equal(y[:top], base[name][:top]))
            row["max_rel_diff"] = float((invariant_linear(x, w0).float() - F.linear(x, w0).float()).abs().max()
                                         / F.linear(x, w0).float().abs().max())
            print(json.dumps(row), flush=True)
            out.append(row)
        del ws, w0
        torch.cuda.empty_cache()
    write_rows(args.output_json, out)


if __name__ == "__main__":
    main()
