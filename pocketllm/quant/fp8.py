"""Block-scaled FP8 weights (DeepSeek-V3/R1's checkpoints, Qwen3's and others' FP8 releases): each
[out, in] matrix held as float8 e4m3 values with one float32 `weight_scale_inv` per tile of
`weight_block_size` (128 x 128), the weight being value * scale (transformers' `FineGrainedFP8Config`,
vLLM's `Fp8LinearMethod` with block quantization).

The config says so: `quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`. Checkpoints scaled per tensor, or with static activation scales, are
other formats, refused by `Fp8Blocks.of`.

Where the platform multiplies them as they are (the GPU's kernels, kernels/triton/fp8.py), the loader
passes an `Fp8Weight` to the layer: a `Linear` keeps it (`Fp8Linear`: half the bytes of bfloat16) where its
`keeps_fp8` says so; elsewhere, and in other modules, it is dequantized at load.
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
        if block[0] % 16 or block[1] % 16:  # (the kernels' tiles divide them)
            raise UnsupportedFeatureError(f"fp8 scale blocks of {block[0]} x {block[1]} are not supported: only "
                                          "blocks whose sides are multiples of 16 (DeepSeek's and Qwen3's: 128 x 128)")
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


@dataclass
class Fp8Weight:
    """A checkpoint weight as stored: float8 `values` [rows, cols] and float32 `scale_inv` a tile of `blocks`;
    `dtype` the model's (what dequantizing gives)."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    blocks: Fp8Blocks
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.values.to(device), self.scale_inv.to(device), self.blocks, self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.blocks.dequantize(self.values, self.scale_inv, self.dtype)


class Fp8Linear(torch.nn.Module):
    """y = x @ W.T (+ bias) with W kept as block-scaled FP8 (Fp8Weight's parts, stacked along the rows where
    every part but the last is a whole number of tiles tall: a fused projection's)."""

    def __init__(self, parts: list[Fp8Weight], bias: torch.Tensor | None):
        super().__init__()
        assert self.stacks(parts)
        self.blocks = parts[0].blocks
        self.values = torch.cat([p.values for p in parts]) if len(parts) > 1 else parts[0].values.contiguous()
        # (float32 and contiguous once, as the kernels read them: not a conversion a step)
        self.scale_inv = torch.cat([p.scale_inv for p in parts]).float().contiguous()
        self.bias = bias
        self.out_features, self.in_features = self.values.shape

    @staticmethod
    def stacks(parts: list[Fp8Weight]) -> bool:
        """Whether these parts stack into one layer (each but the last a whole number of tiles tall)."""
        return len({p.blocks for p in parts}) == 1 and all(p.shape[0] % p.blocks.rows == 0 for p in parts[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pocketllm.kernels.triton.fp8 import fp8_matmul

        shape = x.shape
        y = fp8_matmul(x.reshape(-1, shape[-1]), self.values, self.scale_inv, (self.blocks.rows, self.blocks.cols),
                       self.bias)
        return y.reshape(*shape[:-1], -1)
