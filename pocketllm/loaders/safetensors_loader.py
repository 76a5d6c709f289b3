"""Hugging Face safetensors directories: one file or shards listed in model.safetensors.index.json.
Files are memory-mapped; each tensor is read once, straight into its module."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pocketllm.errors import ConfigurationError


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigurationError(f"{model_dir} has no .safetensors weights")
    return files


def iter_safetensors(model_dir: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # uint8 tensors are packed codes (MXFP4 blocks and exponents), not numbers to convert
                yield name, t if t.dtype == torch.uint8 else t.to(dtype)
