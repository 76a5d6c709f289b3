"""`pocketllm quantize SRC OUT --type TYPE`: a Hugging Face model directory -> a quantized GGUF file (or, with
FP8, a block-scaled FP8 Hugging Face directory)."""
from __future__ import annotations

import argparse
import sys

from pocketllm.quant.mixes import ALIASES, FILE_TYPES


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    from pocketllm.quant.quantize import SUPPORTED

    # the file types whose main type we quantize (the lattice i-quants and MXFP4 we only read)
    types = ", ".join([n for n, (_, t) in FILE_TYPES.items() if t in SUPPORTED]
                      + [f"{a} (= {b})" for a, b in ALIASES.items()])
    parser.add_argument("src", metavar="SRC", help="Hugging Face model directory (config.json, *.safetensors, "
                                                   "tokenizer.json or tokenizer.model)")
    parser.add_argument("out", metavar="OUT", help="GGUF file to write (with --type FP8: a directory)")
    parser.add_argument("--type", "-t", dest="qtype", default="Q8_0", metavar="TYPE",
                        help=f"file type, as llama-quantize names them (default Q8_0): {types}; or FP8: "
                             "safetensors with 128x128 block-scaled FP8 projections, as DeepSeek and Qwen publish")
    parser.add_argument("--pure", action="store_true",
                        help="no k-quant mix: every quantizable tensor gets TYPE's main type")
    parser.add_argument("--output-tensor-type", default=None, metavar="GGML_TYPE",
                        help="type of output.weight (and of tied embeddings), e.g. Q8_0")
    parser.add_argument("--token-embedding-type", default=None, metavar="GGML_TYPE",
                        help="type of token_embd.weight, e.g. Q8_0")
    parser.add_argument("--name", default=None, help="general.name (default: the model's name)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no per-tensor progress")


def run(args: argparse.Namespace) -> int:
    from pocketllm.loaders.gguf_writer import write_gguf

    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    if args.qtype.upper() == "FP8":  # a Hugging Face directory again, its projections block-scaled FP8
        from pocketllm.loaders.fp8_writer import write_checkpoint

        print(f"wrote {write_checkpoint(args.src, args.out, progress=progress)} (block-scaled FP8 safetensors)")
        return 0
    result = write_gguf(args.src, args.out, args.qtype, pure=args.pure, output_type=args.output_tensor_type,
                        token_embedding_type=args.token_embedding_type, name=args.name, progress=progress)
    print(f"wrote {result.path} ({result.file_type}, {result.n_bytes / 2**20:.1f} MiB, "
          f"{result.n_params / 1e6:.1f}M parameters, {result.seconds:.1f} s)\n"
          f"  tensor types: {result.type_mix()}\n  tokenizer: {result.tokenizer}")
    return 0
