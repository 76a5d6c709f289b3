"""The CUDA C GGUF GEMV (pocketllm/kernels/cuda/gguf_gemv.cu) against the Triton 8-bit GEMV
(kernels/triton/gguf_q8.py), one activation row, on a CUDA GPU.

    python benchmarks/kernels/bench_cuda_gemv.py                                   # Q4_K Q6_K Q5_K Q8_0, 8B shapes
    python benchmarks/kernels/bench_cuda_gemv.py --types Q4_K --variants 2x128,4x128,8x256 --shapes 4096x4096

Each timed call reads its weights from memory, as a decode step does: the weight is copied until the
copies exceed 400 MB (several times the 50-60 MB L2), and one CUDA graph multiplies by each copy in
turn; the time is the graph's replay (triton.testing.do_bench_cudagraph) over the copies.  GB/s counts
the weight's GGUF bytes.  Every variant's output is checked against the Triton kernel's.  Variants:
RxNT = R weight rows a block of NT threads, a block a tile of R rows; RxNTxW: W blocks an SM, each taking
tiles in turn.  --float: Triton's GEMV on float activations (the exact kernel) timed too.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import triton
from gguf import GGMLQuantizationType as T

from pocketllm.bench.report import environment
from pocketllm.core.gguf_types import row_nbytes
from pocketllm.kernels.cuda import gguf_gemv as cg
from pocketllm.kernels.triton import gguf as kg
from pocketllm.kernels.triton.int8_act import quantize_activations
from pocketllm.loaders.dummy_gguf import _random_blocks

# Llama-3.1-8B: qkv, o, gate+up, down, k or v; the output layer for Q6_K
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]
HEAD = (128256, 4096)


def timed(fn, copies: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / copies


def write_rows(path: str | None, rows: list[dict]) -> None:
    """A kernel benchmark's rows as JSON, with the machine, commit and command (``bench.report``)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(**environment(), rows=rows), f, indent=1)


def weight_copies(qtype: T, n: int, k: int) -> tuple[list[torch.Tensor], int]:
    """Random [n, k] weights of ``qtype`` packed on the GPU, copied past 400 MB (the docstring's reason),
    and their GGUF bytes."""
    raw = torch.from_numpy(_random_blocks(np.random.default_rng(0), qtype, (n, k), 0.02))
    w0 = kg.pack_gguf(raw, qtype, k, "cuda")
    nbytes = n * row_nbytes(qtype, k)
    return [w0] + [w0.clone() for _ in range(max(1, min(64, -(-400_000_000 // nbytes))) - 1)], nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_K,Q8_0")
    ap.add_argument("--variants", default="1x64,2x64,2x128,4x64,4x128,8x128,8x256,16x256")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="NxK,... (and the output layer for Q6_K)")
    ap.add_argument("--float", action="store_true", help="time the Triton GEMV on float activations too")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    variants = [(tuple(map(int, v.split("x"))) + (0,))[:3] for v in args.variants.split(",")]
    rows = []
    for name in args.types.split(","):
        qtype = T[name]
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        for n, k in shapes + ([HEAD] if qtype == T.Q6_K else []):
            ws, nbytes = weight_copies(qtype, n, k)
            w0, copies = ws[0], len(ws)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            x8 = quantize_activations(x)
            os.environ["POCKETLLM_DISABLE_CUDA_C"] = "1"
            q8 = dict(packed=True, x8=x8, regime="gemv_q8")
            ref = kg.gguf_matmul(x, w0, qtype, k, **q8).float()
            t_triton = timed(lambda: [kg.gguf_matmul(x, w, qtype, k, **q8) for w in ws], copies)
            row = dict(type=name, n=n, k=k, bytes=nbytes, copies=copies, triton_us=t_triton, cuda={})
            if args.float:
                row["triton_float_us"] = timed(lambda: [kg.gguf_matmul(x, w, qtype, k, packed=True, regime="gemv")
                                                   for w in ws], copies)
            del os.environ["POCKETLLM_DISABLE_CUDA_C"]
            for r, nt, wv in variants:
                y = cg.gemv(*x8, w0, qtype, k, n, 1, torch.bfloat16, r=r, nt=nt, w=wv).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                t = timed(lambda r=r, nt=nt, wv=wv: [cg.gemv(*x8, w, qtype, k, n, 1, torch.bfloat16, r=r, nt=nt, w=wv)
                                                     for w in ws], copies)
                row["cuda"][f"{r}x{nt}" + (f"x{wv}" if wv else "")] = dict(us=t, rel_err=err)
            best = min(row["cuda"], key=lambda v: row["cuda"][v]["us"])
            tb = row["cuda"][best]["us"]
            fl = f"(float {row['triton_float_us']:.1f}) " if "triton_float_us" in row else ""
            print(f"{name:5s} {n:6d}x{k:<5d} triton {t_triton:7.1f} us {fl}{nbytes / t_triton / 1e3:5.0f} GB/s | "
                  f"cuda best {best:6s} {tb:7.1f} us {nbytes / tb / 1e3:5.0f} GB/s ({t_triton / tb:4.2f}x) | "
                  + " ".join(f"{v}:{d['us']:.1f}" for v, d in row["cuda"].items())
                  + f" | max rel err {max(d['rel_err'] for d in row['cuda'].values()):.1e}", flush=True)
            rows.append(row)
            del ws, w0
            torch.cuda.empty_cache()
    write_rows(args.output_json, rows)


if __name__ == "__main__":
    main()
