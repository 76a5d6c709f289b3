"""`pocketllm` command line: serve, generate, chat, pull, quantize, dummy-gguf, bench.

Only the chosen command's module is imported, so e.g. `pocketllm bench` needs no server packages.
A user's mistake ends the command with one line on stderr and exit code 2; `--debug` shows the
traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pocketllm import __version__
from pocketllm.errors import PocketLLMError

_HERE = Path(__file__).resolve().parents[1]  # the package: a clone's checkout, or site-packages
# command -> (module with `add_arguments(parser, command)` and `run(args) -> int | None`, help)
_COMMANDS = {
    "serve": ("pocketllm.cli.serve", "serve the OpenAI-compatible API (the default model if none is given)"),
    "generate": ("pocketllm.cli.generate", "print a completion of a prompt"),
    "chat": ("pocketllm.cli.chat", "chat with a model in the terminal"),
    "pull": ("pocketllm.cli.pull", "download a model (a Hugging Face repo, or the default) into the cache"),
    "list": ("pocketllm.cli.pull", "list the models in the cache"),
    "rm": ("pocketllm.cli.pull", "remove a model from the cache"),
    "quantize": ("pocketllm.cli.quantize", "write a quantized GGUF from a Hugging Face model"),
    "dummy-gguf": ("pocketllm.cli.dummy_gguf", "write a random-weight GGUF of a model shape (benchmarks)"),
}
_BENCH = {
    "latency": ("pocketllm.bench.offline", "single-batch latency of the offline engine"),
    "throughput": ("pocketllm.bench.offline", "offline throughput at a given concurrency"),
    "serve": ("pocketllm.bench.serve", "serving benchmark against a running server"),
}
# What a user gets wrong: settings, requests and paths (ValueError: argument checks).
USER_ERRORS = (PocketLLMError, OSError, ValueError)
_DEBUG_HELP = "on an error, show the full traceback instead of one line"


def _add_debug(parser: argparse.ArgumentParser) -> None:
    # Also accepted after the command; SUPPRESS keeps a global --debug from being reset there.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)


class _Version(argparse.Action):
    """argparse's own version action wraps to the terminal's width; a path must stay on one line."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"pocketllm {__version__} (the pocketllm-engine distribution, from {_HERE})")
        parser.exit()


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm", description="PocketLLM inference engine")
    parser.add_argument("--version", action=_Version, help="print the version and where it runs from, and exit")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    words = [a for a in argv if not a.startswith("-")]
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_debug(p)
        if words[:1] == [name]:
            p.set_defaults(_module=module, _parser=p)
            importlib.import_module(module).add_arguments(p, name)
    bench_parser = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    _add_debug(bench_parser)
    bench = bench_parser.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCH.items():
        p = bench.add_parser(name, help=help_text, description=help_text)
        _add_debug(p)
        if words[:2] == ["bench", name]:
            p.set_defaults(_module=module, _parser=p)
            importlib.import_module(module).add_arguments(p, name)
    return parser


def _message(error: BaseException) -> str:
    """The error on one line."""
    if isinstance(error, OSError) and error.filename and error.strerror:
        return f"{error.filename}: {error.strerror}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's usage, not the top-level one
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    command = args.command if args.command != "bench" else f"bench {args.bench}"
    try:
        return importlib.import_module(args._module).run(args) or 0
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"pocketllm {command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        return 130


if __name__ == "__main__":
    sys.exit(main())
