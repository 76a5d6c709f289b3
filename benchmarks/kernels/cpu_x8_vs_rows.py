"""A GGUF type's two CPU fast-path kernels in one process on the same weights: the row kernel (the file's
layout) against the interleaved eight-row layout (``repack_x8``), alternated, at decode shapes of a 1.5B
model, 1 and 2 threads; the median over 7 rounds of each one's best of 10 calls, and the weight bytes a
second the interleaved one reads.

    python benchmarks/kernels/cpu_x8_vs_rows.py --type Q2_K
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from cpu_kernels_vs_ggml import best_of
from gguf import GGMLQuantizationType as T

from pocketllm.bench.report import environment
from pocketllm.core.gguf_types import row_nbytes
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.loaders.dummy_gguf import _random_blocks

SHAPES = [(8960, 1536, 1), (1536, 8960, 1), (8960, 1536, 4), (8960, 1536, 64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q2_K")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    qtype = T[args.type]
    env = environment()
    print(f"# {env['machine']['cpu']}, {env['date']}, commit {env['commit']}{' (dirty)' if env['dirty'] else ''}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for n, k, m in SHAPES:
            raw = torch.from_numpy(_random_blocks(np.random.default_rng(0), qtype, (n, k), 0.02)).view(n, -1)
            rows = gguf_ops.row_pointers([raw])
            packed = gguf_ops.repack_x8(rows, qtype, k)
            assert packed is not None, f"this build has no interleaved {qtype.name} kernel"
            x = torch.randn(m, k)
            times = {"rows": [], "x8": []}
            for _ in range(7):  # alternated: the machine's drift falls on both
                times["rows"].append(best_of(lambda: gguf_ops.gemm(x, rows, qtype, int8=1), 10))
                times["x8"].append(best_of(lambda: gguf_ops.gemm_x8(x, packed, n, qtype), 10))
            a, b = (float(np.median(times[key])) for key in ("rows", "x8"))  # ms
            print(f"{qtype.name} threads {threads} {n}x{k} rows {m}: row kernel {a:.3f} ms, interleaved {b:.3f} ms "
                  f"-> {a / b:.2f}x ({n * row_nbytes(qtype, k) / b / 1e6:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
