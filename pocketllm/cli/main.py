"""`pocketllm` command line: serve, generate, chat, pull, quantize, dummy-gguf, bench.

Only the chosen command's module is imported, so e.g. `pocketllm bench` needs no server packages.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module with `add_arguments(parser, command)` and `run(args) -> int | None`, help)
_COMMANDS = {
    "serve": ("pocketllm.cli.serve", "serve the OpenAI-compatible API (the default model if none is given)"),
    "generate": ("pocketllm.cli.generate", "print a completion of a prompt"),
    "chat": ("pocketllm.cli.chat", "chat with a model in the terminal"),
    "pull": ("pocketllm.cli.pull", "download the default model into the cache"),
    "quantize": ("pocketllm.cli.quantize", "write a quantized GGUF from a Hugging Face model"),
    "dummy-gguf": ("pocketllm.cli.dummy_gguf", "write a random-weight GGUF of a model shape (benchmarks)"),
}
_BENCH = {
    "latency": ("pocketllm.bench.offline", "single-batch latency of the offline engine"),
    "throughput": ("pocketllm.bench.offline", "offline throughput at a given concurrency"),
    "serve": ("pocketllm.bench.serve", "serving benchmark against a running server"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm", description="PocketLLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    words = [a for a in argv if not a.startswith("-")]
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if words[:1] == [name]:
            p.set_defaults(_module=module)
            importlib.import_module(module).add_arguments(p, name)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCH.items():
        p = bench.add_parser(name, help=help_text, description=help_text)
        if words[:2] == ["bench", name]:
            p.set_defaults(_module=module)
            importlib.import_module(module).add_arguments(p, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
