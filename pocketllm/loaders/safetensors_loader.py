"""Hugging Face safetensors directories: one file or shards listed in model.safetensors.index.json.
Files are memory-mapped; each tensor is read once, straight into its module."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pocketllm.errors import ConfigurationError
from pocketllm.quant.fp8 import FP8, SCALE_SUFFIX, Fp8Blocks, Fp8Weight


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


def tensor_names(model_dir: str | Path, dtype: str | None = None) -> set[str]:
    """Every tensor's name (those of safetensors `dtype` only, "F8_E4M3" say), from the files' headers (no
    tensor is read)."""
    names: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.update(n for n in f.keys() if dtype is None or f.get_slice(n).get_dtype() == dtype)  # noqa: SIM118
    return names


def iter_safetensors(model_dir: str | Path, dtype: torch.dtype, fp8: Fp8Blocks | None = None,
                     keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """Every tensor in `dtype` (those whose names `keep` accepts; the others are not read); with `fp8` (a
    block-scaled FP8 checkpoint) each float8 weight as an Fp8Weight, with its `weight_scale_inv` (wherever
    that is stored, not yielded itself): the layer keeps it or dequantizes it."""
    handles = {path: safe_open(str(path), framework="pt") for path in safetensors_files(model_dir)}
    # each scale's file, for weights whose scales are in another shard
    scales = {} if fp8 is None else {name: f for f in handles.values() for name in f.keys()
                                     if name.endswith(SCALE_SUFFIX)}
    for f in handles.values():
        for name in f.keys():
            if name in scales or (keep is not None and not keep(name)):
                continue
            t = f.get_tensor(name)
            if t.dtype != FP8:  # uint8 tensors are packed codes (MXFP4 blocks and exponents), not numbers to convert
                yield name, t if t.dtype == torch.uint8 else t.to(dtype)
                continue
            if fp8 is None:
                raise ConfigurationError(f"{name} is float8 but config.json has no fp8 quantization_config")
            if name + SCALE_SUFFIX not in scales:
                raise ConfigurationError(f"the fp8 weight {name} has no {name + SCALE_SUFFIX} in the checkpoint")
            yield name, Fp8Weight(t, scales[name + SCALE_SUFFIX].get_tensor(name + SCALE_SUFFIX), fp8, dtype)
