"""`pocketllm dummy-gguf OUT --shape llama3-8b --type Q4_K_M`: a random-weight GGUF of a named model
shape, in a quantized mix, without weights or network (for benchmarks)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    from pocketllm.core.shapes import SHAPES

    parser.add_argument("out", metavar="OUT", help="GGUF file to write")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="model shape (default llama3-8b)")
    parser.add_argument("--type", "-t", dest="qtype", default="Q4_K_M", metavar="TYPE",
                        help="file type, as llama-quantize names them (default Q4_K_M): the k-quant mixes, "
                             "the i-quant mixes (IQ1_S ... IQ4_XS), MXFP4_MOE, Q8_0, ...")
    parser.add_argument("--pure", action="store_true",
                        help="no mix: every quantizable tensor gets TYPE's main type (MXFP4 for MXFP4_MOE)")
    parser.add_argument("--layers", type=int, metavar="N",
                        help="only N layers of the shape: its layers' kernels in a smaller file (a big shape's "
                             "benchmarks on a smaller card)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--std", type=float, default=0.02, help="standard deviation of the weights (default 0.02)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no per-tensor progress")


def run(args: argparse.Namespace) -> int:
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf

    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    result = write_dummy_gguf(args.out, args.shape, args.qtype, seed=args.seed, std=args.std,
                              pure=args.pure, layers=args.layers, progress=progress)
    depth = "" if args.layers is None else f", {args.layers} layers"
    print(f"wrote {result.path} ({args.shape}{depth}, {result.file_type}, random weights, {result.n_bytes / 2**20:.1f} MiB, "
          f"{result.n_params / 1e6:.1f}M parameters, {result.seconds:.1f} s)\n  tensor types: {result.type_mix()}")
    return 0
