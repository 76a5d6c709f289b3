"""Random weights for a model of any shape (`load_format="dummy"`), fed through the same
`load_weights` path as a checkpoint, under the checkpoint's own tensor names."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from pocketllm.layers.linear import Embedding, Linear
from pocketllm.layers.norm import RMSNorm
from pocketllm.models.base import CausalLM
from pocketllm.quant.fp8 import FP8, FP8_MAX, Fp8Blocks, Fp8Weight


def fp8_layers(model: CausalLM) -> set[str]:
    """The layers a dummy block-scaled FP8 release holds in FP8: every projection, not the output layer (as
    DeepSeek's and Qwen3's releases)."""
    return {path for path, m in model.named_modules() if isinstance(m, Linear) and path != "lm_head"}


def dummy_weights(model: CausalLM, dtype: torch.dtype, device, seed: int = 0, std: float = 0.02,
                  fp8: Fp8Blocks | None = None) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """`fp8`: the shape is a block-scaled FP8 release: its projections (not the output layer) come as FP8
    values of about the same spread, with one scale."""
    unpacked = {fused: name for name, fused in model.packed_modules.items()}
    in_fp8 = fp8_layers(model) if fp8 is not None else set()
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def fp8_weight(rows: int, cols: int) -> Fp8Weight:
        values = (torch.randn(rows, cols, generator=g, device=device) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return Fp8Weight(values, torch.full(fp8.scale_shape(rows, cols), std / 64, device=device), fp8, dtype)

    for path, m in list(model.named_modules()):
        parent, _, leaf = path.rpartition(".")
        prefix = f"{parent}." if parent else ""
        if isinstance(m, Linear):
            if path == "lm_head" and model.cfg.tie_word_embeddings:
                continue
            for shard, size in enumerate(m.out_sizes):
                name = unpacked.get((leaf, shard), leaf)
                yield f"{prefix}{name}.weight", (fp8_weight if path in in_fp8 else randn)(size, m.in_features)
                if m.bias is not None:
                    yield f"{prefix}{name}.bias", randn(size)
        elif isinstance(m, Embedding):
            yield f"{path}.weight", randn(m.num_embeddings, m.dim)
        elif isinstance(m, RMSNorm):
            # Gemma-style norms scale by 1 + w: w = 0 is the identity scale there.
            yield f"{path}.weight", torch.full_like(m.weight, 0.0 if m.offset else 1.0)
        elif hasattr(m, "load") and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() == 1:
            # per-expert or per-head vectors (V3's score correction, gpt-oss's sinks): zeros change nothing
            yield f"{path}.weight", torch.zeros(m.weight.shape, dtype=m.weight.dtype, device=device)
