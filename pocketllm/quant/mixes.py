"""File types ("Q4_K_M", "Q8_0", ...) and the tensor type each tensor gets in them.

This follows llama.cpp's ``src/llama-quant.cpp`` (``llama_tensor_get_type``) for its file types: which
tensors are quantized at all, the per-category bumps of the k-quant and i-quant mixes (``use_more_bits``
layers of attn_v / ffn_down, Q6_K output and tied embeddings, Q2_K / IQ3_S embeddings of the 1-2 bit
i-quants, ...), and the fallbacks for rows whose length is not a multiple of the block size (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, the 256-wide i-quants -> IQ4_NL, then F16). The mixes are
those of llama-quantize without an importance matrix. The float file types follow llama.cpp's converter
instead: 1-D tensors and norms F32, the rest F32/F16/BF16.

Not every file type's tensor types can be quantized by ``pocketllm quantize``; ``pocketllm dummy-gguf``
writes them all.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from gguf import GGMLQuantizationType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

T = GGMLQuantizationType
F = LlamaFileType

# name -> (file type, the type most tensors get); llama-quantize's aliases included
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "F32": (F.ALL_F32, T.F32), "F16": (F.MOSTLY_F16, T.F16), "BF16": (F.MOSTLY_BF16, T.BF16),
    "Q8_0": (F.MOSTLY_Q8_0, T.Q8_0),
    "Q4_0": (F.MOSTLY_Q4_0, T.Q4_0), "Q4_1": (F.MOSTLY_Q4_1, T.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, T.Q5_0), "Q5_1": (F.MOSTLY_Q5_1, T.Q5_1),
    "Q2_K": (F.MOSTLY_Q2_K, T.Q2_K),
    "Q3_K_S": (F.MOSTLY_Q3_K_S, T.Q3_K), "Q3_K_M": (F.MOSTLY_Q3_K_M, T.Q3_K), "Q3_K_L": (F.MOSTLY_Q3_K_L, T.Q3_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, T.Q4_K), "Q4_K_M": (F.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, T.Q5_K), "Q5_K_M": (F.MOSTLY_Q5_K_M, T.Q5_K),
    "Q6_K": (F.MOSTLY_Q6_K, T.Q6_K),
    "IQ1_S": (F.MOSTLY_IQ1_S, T.IQ1_S), "IQ1_M": (F.MOSTLY_IQ1_M, T.IQ1_M),
    "IQ2_XXS": (F.MOSTLY_IQ2_XXS, T.IQ2_XXS), "IQ2_XS": (F.MOSTLY_IQ2_XS, T.IQ2_XS),
    "IQ2_S": (F.MOSTLY_IQ2_S, T.IQ2_XS), "IQ2_M": (F.MOSTLY_IQ2_M, T.IQ2_S),  # (sic: llama.cpp's defaults)
    "IQ3_XXS": (F.MOSTLY_IQ3_XXS, T.IQ3_XXS), "IQ3_XS": (F.MOSTLY_IQ3_XS, T.IQ3_S),
    "IQ3_S": (F.MOSTLY_IQ3_S, T.IQ3_S), "IQ3_M": (F.MOSTLY_IQ3_M, T.IQ3_S),
    "IQ4_NL": (F.MOSTLY_IQ4_NL, T.IQ4_NL), "IQ4_XS": (F.MOSTLY_IQ4_XS, T.IQ4_XS),
    "MXFP4_MOE": (F.MOSTLY_MXFP4_MOE, T.MXFP4),  # MXFP4 experts, the rest Q8_0
}
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize spells them

_FLOAT_FTYPES = {F.ALL_F32, F.MOSTLY_F16, F.MOSTLY_BF16}
# 256-wide type -> the 32-wide type llama.cpp falls back to when a row is not a multiple of 256
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
             **{t: T.IQ4_NL for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                                      T.IQ4_XS)}}
# the 1-2 bit i-quant file types, which share one branch of llama_tensor_get_type_impl
_IQ_LOW = frozenset({F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M, F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ2_S,
                     F.MOSTLY_IQ2_M})
_ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")


def parse_file_type(name: str) -> tuple[str, LlamaFileType, GGMLQuantizationType]:
    """'q4_k_m' -> ('Q4_K_M', MOSTLY_Q4_K_M, Q4_K). Raises ValueError for an unknown name."""
    key = name.strip().upper().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in FILE_TYPES:
        known = ", ".join(list(FILE_TYPES) + [f"{a} (= {b})" for a, b in ALIASES.items()])
        raise ValueError(f"unknown quantization type {name!r}; choose one of: {known}")
    return (key, *FILE_TYPES[key])


def allows_quantization(name: str, n_dims: int) -> bool:
    """llama.cpp's tensor_allows_quantization for the dense decoder tensors we write."""
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def category(name: str) -> str:
    """llama.cpp's tensor_get_category."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers llama.cpp's k-quant mixes give more bits: the first and last eighth, and every third
    layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def layer_order(name: str) -> tuple[int, str]:
    """llama.cpp's weight_name_comparer: global tensors first, then by block number, then by name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def fallback(qtype: GGMLQuantizationType, ncols: int) -> GGMLQuantizationType:
    """llama.cpp's tensor_type_fallback: a type whose block fits rows of `ncols` values."""
    if ncols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    new = _FALLBACK.get(qtype, qtype)
    if ncols % GGML_QUANT_SIZES[new][0] != 0:
        new = T.F16
    return new


def tensor_types(tensors: Iterable[tuple[str, Sequence[int]]], file_type: str | LlamaFileType, *,
                 n_layer: int, n_head: int, n_head_kv: int, n_expert: int = 0, is_70b: bool = False,
                 pure: bool = False, output_type: GGMLQuantizationType | None = None,
                 token_embedding_type: GGMLQuantizationType | None = None) -> dict[str, GGMLQuantizationType]:
    """GGUF tensor name -> type for a file type. `tensors` are (GGUF name, shape) with shape in numpy order
    (rows first, row length last). `pure`: every quantizable tensor gets the file type's main type (llama-quantize
    --pure); `output_type` / `token_embedding_type` override those two tensors (--output-tensor-type /
    --token-embedding-type)."""
    if isinstance(file_type, str):
        _, ftype, default = parse_file_type(file_type)
    else:
        ftype = F(file_type)
        default = next(t for f, t in FILE_TYPES.values() if f == ftype)
    tensors = sorted(((n, tuple(int(s) for s in shape)) for n, shape in tensors), key=lambda t: layer_order(t[0]))
    names = [n for n, _ in tensors]
    state = _State(ftype=ftype, n_layer=n_layer, n_gqa=n_head // n_head_kv if n_head_kv else 0, n_expert=n_expert,
                   is_70b=is_70b, tied=not any(category(n) == "output" for n in names),
                   n_attention_wv=sum(category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names))
    out: dict[str, GGMLQuantizationType] = {}
    for name, shape in tensors:
        if not allows_quantization(name, len(shape)):
            out[name] = T.F32
            continue
        if ftype in _FLOAT_FTYPES:
            out[name] = default  # the converter's choice; llama-quantize keeps non-quantized types too
            continue
        cat = category(name)
        # explicit types for these two (llama.cpp would fail on rows they do not fit: we fall back instead)
        if token_embedding_type is not None and cat == "token_embd":
            out[name] = fallback(T(token_embedding_type), shape[-1])
            continue
        if output_type is not None and cat == "output":
            out[name] = fallback(T(output_type), shape[-1])
            continue
        new = default
        if not pure:
            new = state.get_type(new, name, shape, cat, output_type)
        out[name] = fallback(new, shape[-1])
    return out


class _State:
    """quantize_state_impl plus llama_tensor_get_type_impl (no importance matrix, no Falcon)."""

    def __init__(self, *, ftype, n_layer, n_gqa, n_expert, is_70b, tied, n_attention_wv):
        self.ftype, self.n_layer, self.n_gqa, self.n_expert = ftype, n_layer, n_gqa, n_expert
        self.is_70b, self.tied = is_70b, tied
        self.n_attention_wv, self.i_attention_wv = n_attention_wv, 0
        self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0

    def _layer(self, counter: int, name: str) -> int:
        if self.n_expert > 1:  # experts are not consecutive: read the layer from the name
            return int(re.match(r"blk\.(\d+)\.", name).group(1))
        return counter

    def get_type(self, new: GGMLQuantizationType, name: str, shape: tuple[int, ...], cat: str,
                 output_type) -> GGMLQuantizationType:
        ft = self.ftype
        if cat == "output" or (self.tied and cat == "token_embd"):
            # tied embeddings are quantized as the output tensor
            if output_type is not None:
                return T(output_type)
            if ft == F.MOSTLY_MXFP4_MOE or shape[-1] % GGML_QUANT_SIZES[new][0] != 0:
                return T.Q8_0
            if ft in _IQ_LOW or ft == F.MOSTLY_IQ3_XXS:
                return T.Q5_K
            return new if new == T.Q8_0 else T.Q6_K
        if ft == F.MOSTLY_MXFP4_MOE:  # stacked expert tensors [n_expert, rows, cols] MXFP4, the rest Q8_0
            return T.MXFP4 if len(shape) >= 3 and shape[-3] > 1 else T.Q8_0
        if cat == "token_embd":
            if ft in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
                return T.Q2_K
            if ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ3_XXS):
                return T.IQ3_S
            return new
        if ft in _IQ_LOW:
            return self._iq_low(new, cat)
        if cat in _ATTN_V:
            return self._attn_v(new)
        if cat in ("attn_k", "attn_q"):
            if cat == "attn_k" and self.n_expert == 8:
                return T.Q8_0
            if ft == F.MOSTLY_IQ3_XS:
                return T.IQ3_XXS
            return T.IQ2_S if ft == F.MOSTLY_IQ3_XXS else new
        if cat == "ffn_down":
            return self._ffn_down(new, name)
        if cat == "attn_output":
            if self.n_expert == 8:
                if ft in (F.MOSTLY_Q2_K, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M,
                          F.MOSTLY_IQ4_NL, F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M, F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M,
                          F.MOSTLY_IQ4_XS):
                    new = T.Q5_K
                return new
            return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_IQ3_XXS: T.IQ3_S, F.MOSTLY_Q3_K_M: T.Q4_K,
                    F.MOSTLY_Q3_K_L: T.Q5_K, F.MOSTLY_IQ3_M: T.Q4_K}.get(ft, new)
        if cat in ("ffn_gate", "ffn_up"):
            if cat == "ffn_gate":
                i = self._layer(self.i_ffn_gate, name)
                self.i_ffn_gate += 1
            else:
                i = self._layer(self.i_ffn_up, name)
                self.i_ffn_up += 1
            if ft == F.MOSTLY_IQ3_XS and self.n_layer // 8 <= i < 7 * self.n_layer // 8:
                new = T.IQ3_XXS
        return new

    def _iq_low(self, new: GGMLQuantizationType, cat: str) -> GGMLQuantizationType:
        """The IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S and IQ2_M files: a few tensors get more bits."""
        ft = self.ftype
        more = T.IQ3_S if ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M) else T.Q2_K
        if cat in _ATTN_V:
            new = T.Q4_K if self.n_gqa >= 4 or self.n_expert >= 4 else more
            self.i_attention_wv += 1
        elif cat == "attn_k" and self.n_expert == 8:
            new = T.Q4_K
        elif cat == "ffn_down":
            if self.i_ffn_down < self.n_layer // 8:
                new = more
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if self.n_expert == 8:
                new = T.Q5_K
            elif ft in (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
                new = T.IQ2_XXS
            elif ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M):
                new = T.IQ3_S
        return new

    def _attn_v(self, new: GGMLQuantizationType) -> GGMLQuantizationType:
        ft, i, gqa4 = self.ftype, self.i_attention_wv, self.n_gqa >= 4
        if ft == F.MOSTLY_Q2_K:
            new = T.Q4_K if gqa4 else T.Q3_K
        elif ft == F.MOSTLY_IQ3_XXS:
            new = T.Q4_K if gqa4 else T.IQ3_S  # (IQ3_XXS given an importance matrix)
        elif ft in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and gqa4:
            new = T.Q4_K
        elif ft == F.MOSTLY_IQ3_M:
            new = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_M:
            new = T.Q5_K if i < 2 else T.Q4_K
        elif ft == F.MOSTLY_Q3_K_L:
            new = T.Q5_K
        elif ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and gqa4:
            new = T.Q5_K
        elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, self.n_attention_wv):
            new = T.Q6_K
        elif ft == F.MOSTLY_Q4_K_S and i < 4:
            new = T.Q5_K
        if self.is_70b and new in (T.Q3_K, T.Q4_K):
            # 8 heads share attn_v in 70B models: more bits there cost little
            new = T.Q5_K
        if self.n_expert == 8:
            new = T.Q8_0
        self.i_attention_wv += 1
        return new

    def _ffn_down(self, new: GGMLQuantizationType, name: str) -> GGMLQuantizationType:
        ft, n_layer = self.ftype, self.n_layer
        i = self._layer(self.i_ffn_down, name)
        if ft == F.MOSTLY_Q2_K:
            new = T.Q3_K
        elif ft == F.MOSTLY_IQ3_XXS:  # (without an importance matrix)
            new = T.Q4_K if i < n_layer // 8 else T.Q3_K
        elif ft == F.MOSTLY_Q3_K_M:
            new = T.Q5_K if i < n_layer // 16 else T.Q4_K  # (Q3_K only on Falcon)
        elif ft == F.MOSTLY_IQ3_M and (i < n_layer // 8 or (self.n_expert == 8 and use_more_bits(i, n_layer))):
            new = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_L:
            new = T.Q5_K
        elif ft == F.MOSTLY_Q4_K_M:
            if use_more_bits(i, n_layer):
                new = T.Q6_K
        elif i < n_layer // 8 and ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS):  # (without an importance matrix)
            new = T.Q5_K
        elif ft == F.MOSTLY_Q5_K_M and use_more_bits(i, n_layer):
            new = T.Q6_K
        elif ft == F.MOSTLY_Q4_K_S and i < n_layer // 8:
            new = T.Q5_K
        self.i_ffn_down += 1
        return new
