"""`pocketllm pull NAME`, `pocketllm list`, `pocketllm rm NAME`: models in the caches, by name."""
from __future__ import annotations

import argparse

from pocketllm.errors import ConfigurationError
from pocketllm.pull import MODELS, pull


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "list":
        return
    parser.add_argument("name", nargs="?" if command == "pull" else None, default="default",
                        help=f"a Hugging Face repo (org/name[@revision][:QUANT]) or one of: {', '.join(sorted(MODELS))}")


def run(args: argparse.Namespace) -> int:
    from pocketllm import hub

    if args.command == "list":
        rows = hub.cached_models()
        for name, size, files in rows:
            print(f"{name:60s} {size / 2**20:10.1f} MiB  {files}")
        if not rows:
            print("no models in the cache")
        return 0
    name = hub.HubName.parse(args.name)
    if args.command == "rm":
        if name is None:
            raise ConfigurationError(f"{args.name!r} is not a model name (org/name)")
        print(f"removed {hub.remove(name)}")
        return 0
    print(pull(args.name) if name is None else hub.resolve(name))
    return 0
