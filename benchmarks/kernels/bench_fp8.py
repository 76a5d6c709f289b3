"""Block-scaled FP8 products (``kernels/triton/fp8.py``) at Llama-3-8B's shapes against cuBLAS on the bf16
weight: the CUDA C GEMV (``dense_gemv.fp8_linear``) for 1-16 rows, and the Triton tiles (``fp8_tiled``) for
all. Weights are read from memory (copies past 256 MB, as bench_dense_gemv.py), all products of a row count
in one CUDA graph. ``dispatch.FP8_GEMV_MAX_M`` follows from it: the GEMV serves the row counts where it wins. With --sweep,
every (R, NT) tile of the GEMV at 1 and 2 rows as well (``cuda_r{R}_t{NT}_us``; ``cuda_us`` is the tile
rule's).

    python benchmarks/kernels/bench_fp8.py [--sweep] [--output-json FILE]   # on a GPU
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cuda_gemv import timed, write_rows
from bench_dense_gemv import each_tile

from pocketllm.kernels.cuda import dense_gemv
from pocketllm.kernels.triton.fp8 import fp8_tiled
from pocketllm.quant.fp8 import FP8, Fp8Blocks

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate/up": (28672, 4096), "8b down": (4096, 14336)}
BLOCK = (128, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    tiles = [None] + ([(r, nt) for r in (1, 2, 4, 8) for nt in (32, 64, 128, 256)] if args.sweep else [])
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks = Fp8Blocks(*BLOCK)
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(64, -(-(256 << 20) // (n * k))))
        values = [(torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(FP8) for _ in range(copies)]
        scales = [torch.rand(blocks.scale_shape(n, k), device=dev) * 1e-3 for _ in range(copies)]
        dense = [blocks.dequantize(v, s, dt) for v, s in zip(values[:max(1, copies // 2)], scales)]
        for m in (1, 2, 4, 16, 64, 512, 2048):
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = dict(shape=name, n=n, k=k, m=m,
                       cublas_bf16_us=timed(lambda: [F.linear(x, w) for w in dense], len(dense)),
                       tiles_us=timed(lambda: [fp8_tiled(x, v, s, BLOCK) for v, s in zip(values, scales)], copies))
            if m <= 16:
                each_tile(row, tiles if m <= 2 else [None],
                          lambda i: dense_gemv.fp8_linear(x, values[i], scales[i], BLOCK), copies)
            row["fp8_gb_s"] = n * k / min(row.get(key, 1e9) for key in ("cuda_us", "tiles_us")) / 1e3
            print(row, flush=True)
            rows.append(row)
        del values, scales, dense
    write_rows(args.output_json, rows)


if __name__ == "__main__":
    main()
