"""Every EngineArgs field as a command-line flag (`max_num_seqs` -> `--max-num-seqs`)."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from pocketllm.config import EngineArgs

_HELP = {
    "model": "Hugging Face model directory or .gguf file (default: the built-in default model)",
    "dtype": "auto | float32 | bfloat16 | float16",
    "device": "auto | cpu | cuda",
    "num_kv_blocks": "number of KV blocks (overrides memory-based sizing)",
    "kv_cache_memory": "bytes of KV cache on CPU",
    "async_scheduling": "launch each step while the GPU runs the one before (default: on for CUDA, off on CPU)",
}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            if positional_model:
                parser.add_argument("model", nargs="?", default=None, help=_HELP["model"])
            else:
                group.add_argument("--model", default=None, help=_HELP["model"])
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if base[0] is bool:
            group.add_argument(flag, type=_bool, nargs="?", const=True, default=f.default,
                               metavar="BOOL", help=_HELP.get(f.name, f"(default: {f.default})"))
            if f.default is not False:
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false")
        else:
            group.add_argument(flag, type=base[0], default=f.default,
                               help=_HELP.get(f.name, f"(default: {f.default})"))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
