"""Block-scaled FP8 weights (DeepSeek-V3/R1's checkpoints, Qwen3's and others' FP8 releases): each
[out, in] matrix held as float8 e4m3 values with one float32 `weight_scale_inv` per tile of
`weight_block_size` (128 x 128), the weight being value * scale (transformers' `FineGrainedFP8Config`,
vLLM's `Fp8LinearMethod` with block quantization).

The config says so: `quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`. Checkpoints scaled per tensor, or with static activation scales, are
other formats, refused by `Fp8Blocks.of`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pocketllm.errors import UnsupportedFeatureError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight's scales are X.weight_scale_inv


@dataclass(frozen=True)
class Fp8Blocks:
    rows: int
    cols: int

    @classmethod
    def of(cls, config: dict) -> Fp8Blocks | None:
        """The block shape a Hugging Face config's quantization_config gives, None for an unquantized
        checkpoint; a quantization this module does not read is refused, before any weight."""
        q = config.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise UnsupportedFeatureError(f"checkpoints quantized with {method!r} are not supported; supported: "
                                          "block-scaled fp8 (quant_method fp8 with weight_block_size), or GGUF files")
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise UnsupportedFeatureError("fp8 checkpoints scaled per tensor are not supported: only block-scaled "
                                          "ones (weight_block_size [128, 128], as DeepSeek-V3 and Qwen3 publish)")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedFeatureError("fp8 checkpoints with static activation scales are not supported: only "
                                          "activation_scheme dynamic")
        return cls(int(block[0]), int(block[1]))

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.rows), -(-cols // self.cols)

    def dequantize(self, values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., rows, cols] float8 values and their [..., ceil(rows/br), ceil(cols/bc)] scales -> the weight in
        `dtype`: each value times its tile's scale, computed in float32 (exact: a 4-bit significand times a
        float32), then rounded once to `dtype`."""
        rows, cols = values.shape[-2:]
        assert scale_inv.shape[-2:] == self.scale_shape(rows, cols), (scale_inv.shape, values.shape, self)
        scale = scale_inv.float().repeat_interleave(self.rows, -2)[..., :rows, :]
        scale = scale.repeat_interleave(self.cols, -1)[..., :cols]
        return (values.float() * scale).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A weight -> (float8 values, float32 scales): each tile multiplied by 448 / amax, so that its largest
        magnitude is FP8_MAX, and rounded to nearest; its scale is the reciprocal of that factor (an all-zero
        tile: 1). The same arithmetic as transformers' Fp8Quantize, so the same bytes."""
        rows, cols = weight.shape[-2:]
        sr, sc = self.scale_shape(rows, cols)
        w = weight.float()
        pad = torch.zeros(*w.shape[:-2], sr * self.rows, sc * self.cols)
        pad[..., :rows, :cols] = w
        tiles = pad.unflatten(-1, (sc, self.cols)).unflatten(-3, (sr, self.rows))  # [..., sr, br, sc, bc]
        amax = tiles.abs().amax(dim=(-3, -1))
        factor = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
        values = (tiles * factor[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return values.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous(), 1.0 / factor


# Which tensors an FP8 checkpoint holds in FP8: the layers' projections (attention, MLP, experts), as DeepSeek and
# Qwen publish them; embeddings, the output layer, norms and routers stay in the source's dtype.
_QUANTIZED = re.compile(r"\.layers\.\d+\..*(_proj|\.w[123]|\.experts\.\d+\.\w+)\.weight$")
SHARD_BYTES = 4 << 30


def write_checkpoint(src: str | os.PathLike, out: str | os.PathLike, block: Fp8Blocks = Fp8Blocks(128, 128),
                     progress=None) -> Path:
    """A Hugging Face directory -> a block-scaled FP8 copy in `out` (safetensors shards of at most 4 GiB with
    their index, config.json with the quantization_config, the tokenizer's and generation files copied)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pocketllm.loaders.safetensors_loader import safetensors_files

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
