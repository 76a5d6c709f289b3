"""Block-scaled FP8 weights (DeepSeek-V3/R1's checkpoints, Qwen3's and others' FP8 releases): each
[out, in] matrix held as float8 e4m3 values with one float32 `weight_scale_inv` per tile of
`weight_block_size` (128 x 128), the weight being value * scale (transformers' `FineGrainedFP8Config`,
vLLM's `Fp8LinearMethod` with block quantization).

The config says so: `quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`. Checkpoints scaled per tensor, or with static activation scales, are
other formats, refused by `Fp8Blocks.of`.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        factor = FP8_MAX / torch.where(amax > 0, amax, FP8_MAX)  # (an all-zero tile: 1)
        values = (tiles * factor[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return values.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous(), 1.0 / factor

