"""GGML tensor types PocketLLM can read, with their block geometry.

Sizes come from ``gguf.constants.GGML_QUANT_SIZES`` so they can never drift
from the file format the ``gguf`` package reads.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

T = GGMLQuantizationType

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    T.F32, T.F16, T.BF16,
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S,
    T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.MXFP4,
})


def block_size(qtype: GGMLQuantizationType) -> int:
    """Number of weights one block holds (1 for plain float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: GGMLQuantizationType) -> int:
    """Number of bytes one block takes."""
    return GGML_QUANT_SIZES[qtype][1]


def row_nbytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes used by a row of ``n`` weights; ``n`` must be a whole number of blocks."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs:
        raise ValueError(f"{qtype.name} rows must hold a multiple of {bs} values, got {n}")
    return n // bs * ts


def check_supported(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """Return ``qtype`` as a ``GGMLQuantizationType``; raise if PocketLLM cannot read it."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        from pocketllm.errors import UnsupportedFeatureError

        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedFeatureError(
            f"GGML tensor type {qtype.name} is not supported; supported types: {names}. "
            "Re-quantize the model to one of them."
        )
    return qtype
