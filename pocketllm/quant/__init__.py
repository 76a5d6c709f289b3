"""GGUF quantized weights: exact dequantization and linear/embedding layers (CPU kernels; on CUDA the
Triton kernels of pocketllm/kernels/triton/gguf.py)."""

from pocketllm.core.gguf_types import SUPPORTED_TYPES, block_size, type_size

from .dequant import dequantize
from .linear import GGUFLinear, gguf_embedding_lookup

__all__ = [
    "SUPPORTED_TYPES",
    "GGUFLinear",
    "block_size",
    "dequantize",
    "gguf_embedding_lookup",
    "type_size",
]
