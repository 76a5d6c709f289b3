"""Hugging Face safetensors directories: one file or shards listed in model.safetensors.index.json.
Files are memory-mapped; each tensor is read once, straight into its module."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pocketllm.errors import ConfigurationError
from pocketllm.quant.fp8 import FP8, SCALE_SUFFIX, Fp8Blocks


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


def iter_safetensors(model_dir: str | Path, dtype: torch.dtype,
                     fp8: Fp8Blocks | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in `dtype`; with `fp8` (a block-scaled FP8 checkpoint) each float8 weight dequantized
    with its `weight_scale_inv` (wherever that is stored), which is not yielded itself."""
    files = safetensors_files(model_dir)
    handles = {}
    try:
        for path in files:
            handles[path] = f = safe_open(str(path), framework="pt")
            for name in f.keys():
                if fp8 is not None and name.endswith(SCALE_SUFFIX):
                    continue
                t = f.get_tensor(name)
                if t.dtype == FP8:
                    if fp8 is None:
                        raise ConfigurationError(f"{name} is float8 but config.json has no fp8 quantization_config")
                    yield name, fp8.dequantize(t, _scale_of(name, files, handles), dtype)
                else:  # uint8 tensors are packed codes (MXFP4 blocks and exponents), not numbers to convert
                    yield name, t if t.dtype == torch.uint8 else t.to(dtype)
    finally:
        handles.clear()


def _scale_of(name: str, files: list[Path], handles: dict) -> torch.Tensor:
    """`name`'s block scales, from whichever file holds them."""
    key = name + SCALE_SUFFIX
    for path in files:
        f = handles.get(path) or handles.setdefault(path, safe_open(str(path), framework="pt"))
        if key in f.keys():
            return f.get_tensor(key)
    raise ConfigurationError(f"the fp8 weight {name} has no {key} in the checkpoint")
