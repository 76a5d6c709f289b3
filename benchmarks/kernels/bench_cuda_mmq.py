"""The integer tensor-core GGUF product (pocketllm/kernels/cuda/gguf_mmq.cu) against the Triton tile kernel
(regime "mma": bf16 tensor cores, codes decoded in registers; its types only) and dequantize + cuBLAS
(regime "dequant"), at a few activation rows, on a CUDA GPU.

    python benchmarks/kernels/bench_cuda_mmq.py --rows 16,32,64 --shapes 6144x4096,28672x4096,4096x14336

Each timed call reads its weights from memory (copies rotated past 400 MB, one CUDA graph over them, as
bench_cuda_gemv.py); the MMQ time includes quantizing the activations to 8 bits.  For the types its bf16
variant takes (``x16``: bf16 activations as they are, weights turned into bf16), that too, at 16, 32 and 64
activation rows a block.  The relative errors are the largest difference from dequantize + cuBLAS's output
over its largest value.
"""
from __future__ import annotations

import argparse

import torch
from bench_cuda_gemv import timed, weight_copies, write_rows
from gguf import GGMLQuantizationType as T

from pocketllm.kernels.cuda import gguf_mmq
from pocketllm.kernels.triton import gguf as kg
from pocketllm.kernels.triton.int8_act import quantize_activations


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ2_XXS")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--shapes", default="6144x4096,4096x4096,28672x4096,4096x14336")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    out = []
    for name in args.types.split(","):
        qtype = T[name]
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            ws, nbytes = weight_copies(qtype, n, k)
            w0, copies = ws[0], len(ws)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = kg.gguf_matmul(x, w0, qtype, k, packed=True, regime="dequant").float()
                regimes = ["mma", "dequant"] if qtype in kg._mma().MMA_TYPES else ["dequant"]

                def mmq(w, bm=None):
                    return gguf_mmq.mmq(*quantize_activations(x), w, qtype, k, n, m, torch.bfloat16, bm=bm)

                err = float((mmq(w0).float() - ref).abs().max() / ref.abs().max())
                row = dict(type=name, n=n, k=k, m=m, bytes=nbytes, copies=copies, rel_err=err)
                for regime in regimes:
                    row[f"{regime}_us"] = timed(lambda: [kg.gguf_matmul(x, w, qtype, k, packed=True, regime=regime)
                                                         for w in ws], copies)
                row["mmq_us"] = timed(lambda: [mmq(w) for w in ws], copies)
                half = gguf_mmq.block_m(m) // 2  # the rows as blocks of half as many
                if half >= 16:
                    row[f"mmq_bm{half}_us"] = timed(lambda: [mmq(w, half) for w in ws], copies)
                best = min(row[f"{r}_us"] for r in regimes)
                x16 = ""
                if gguf_mmq.x16_ok(qtype):
                    y16 = gguf_mmq.mmq_x16(x, w0, qtype, k, n)
                    row["x16_rel_err"] = float((y16.float() - ref).abs().max() / ref.abs().max())
                    for bm in (16, 32, 64):
                        row[f"x16_bm{bm}_us"] = timed(lambda: [gguf_mmq.mmq_x16(x, w, qtype, k, n, bm=bm)
                                                               for w in ws], copies)
                    t16 = min(row[f"x16_bm{bm}_us"] for bm in (16, 32, 64))
                    x16 = (" | x16 bm16/32/64 " + "/".join(f"{row[f'x16_bm{bm}_us']:.1f}" for bm in (16, 32, 64))
                           + f" ({min(best, row['mmq_us']) / t16:4.2f}x the best) err {row['x16_rel_err']:.1e}")
                print(f"{name:7s} {n:6d}x{k:<5d} M={m:3d} | " + " | ".join(f"{r} {row[f'{r}_us']:7.1f} us" for r in regimes)
                      + f" | mmq {row['mmq_us']:7.1f} ({best / row['mmq_us']:4.2f}x the best, "
                      f"{nbytes / row['mmq_us'] / 1e3:5.0f} GB/s)"
                      + (f" | mmq bm{half} {row[f'mmq_bm{half}_us']:7.1f}" if half >= 16 else "")
                      + f" | rel err {err:.1e}" + x16, flush=True)
                out.append(row)
            del ws, w0
            torch.cuda.empty_cache()
    write_rows(args.output_json, out)


if __name__ == "__main__":
    main()
