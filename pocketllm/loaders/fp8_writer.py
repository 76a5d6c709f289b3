"""`pocketllm quantize SRC OUT --type FP8`: a Hugging Face directory -> its block-scaled FP8 copy
(pocketllm.quant.fp8), as DeepSeek and Qwen publish their FP8 checkpoints."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.safetensors_loader import safetensors_files
from pocketllm.quant.fp8 import SCALE_SUFFIX, Fp8Blocks

# Which tensors an FP8 checkpoint holds in FP8: the layers' projections (attention, MLP, experts), as DeepSeek and
# Qwen publish them; embeddings, the output layer, norms and routers stay in the source's dtype.
_QUANTIZED = re.compile(r"\.layers\.\d+\..*(_proj|\.w[123])\.weight$")
SHARD_BYTES = 4 << 30


def write_checkpoint(src: str | os.PathLike, out: str | os.PathLike, block: Fp8Blocks = Fp8Blocks(128, 128),
                     progress=None) -> Path:
    """A Hugging Face directory -> a block-scaled FP8 copy in `out` (safetensors shards of at most 4 GiB with
    their index, config.json with the quantization_config, the tokenizer's and generation files copied)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise UnsupportedFeatureError(f"{src} is quantized already ({config['quantization_config'].get('quant_method')})")
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for path in safetensors_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                t = f.get_tensor(name)
                parts = {name: t}
                if t.dim() == 2 and t.is_floating_point() and _QUANTIZED.search(name):
                    values, scale = block.quantize(t)
                    parts = {name: values, name + SCALE_SUFFIX: scale}
                    if progress:
                        progress(f"{name}: {tuple(t.shape)} -> fp8, scales {tuple(scale.shape)}")
                n = sum(p.numel() * p.element_size() for p in parts.values())
                if size and size + n > SHARD_BYTES:
                    shards.append({})
                    size = 0
                shards[-1].update(parts)
                size += n
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, tensors in zip(names, shards):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block.rows, block.cols]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in _COPIED):
            shutil.copy(f, out / f.name)
    return out


_COPIED = {"generation_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
           "modules.json"}
