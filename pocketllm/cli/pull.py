from __future__ import annotations

import argparse

from pocketllm.pull import MODELS, pull


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("name", nargs="?", default="default", help=f"one of: {', '.join(sorted(MODELS))}")


def run(args: argparse.Namespace) -> int:
    print(pull(args.name))
    return 0
