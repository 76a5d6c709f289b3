"""A GGUF file of a model's shape with random weights, in a quantized mix, without a checkpoint
(``pocketllm dummy-gguf OUT --shape llama3-8b --type Q4_K_M``): for benchmarks on machines that
have no weights and no network.

The file is what ``pocketllm quantize`` would write for a model of that shape (same metadata,
tensor names, per-tensor types of the file type's llama.cpp mix, a byte-level stand-in
vocabulary), but every quantized block is random bytes (random codes; random grid indices and
signs for the i-quants), only its scale fields set: to values that give weights of standard
deviation ``std`` and mean about 0 (calibrated per type on a sample through the exact
dequantizer).  Every type the engine reads can be written, the i-quants and MXFP4 included.
Norm weights are 1, biases 0.  Nothing is quantized, so the 4.9 GB of Llama-3.1-8B in Q4_K_M
take seconds: random bytes, tensor by tensor, streamed.
"""
from __future__ import annotations

import os
import time
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.gguf_writer import (
    WriteResult,
    arch_of,
    expert_count,
    llama3_rope_factors,
    minimal_vocab,
    rope_parameters,
    write_file,
)
from pocketllm.quant import mixes
from pocketllm.quant.dequant import dequantize

T = GGMLQuantizationType

# type -> byte offsets of its fp16 scale fields in a block: (multipliers d, the offset field or None); the
# offset (dmin of the k-quants, m of Q4_1/Q5_1) is set so that weights average ~0. The i-quants have one fp16
# super-scale first; their grid indices, signs and sub-block scales stay random bytes.
_SCALE_FIELDS = {
    T.Q8_0: ((0,), None), T.Q4_0: ((0,), None), T.Q4_1: ((0,), 2), T.Q5_0: ((0,), None),
    T.Q5_1: ((0,), 2), T.Q2_K: ((80,), 82), T.Q3_K: ((108,), None), T.Q4_K: ((0,), 2),
    T.Q5_K: ((0,), 2), T.Q6_K: ((208,), None),
    T.IQ4_NL: ((0,), None), T.IQ4_XS: ((0,), None), T.IQ2_XXS: ((0,), None), T.IQ2_XS: ((0,), None),
    T.IQ2_S: ((0,), None), T.IQ3_XXS: ((0,), None), T.IQ3_S: ((0,), None), T.IQ1_S: ((0,), None),
    T.IQ1_M: ((), None),  # no fp16 field: see _set_scales
    T.MXFP4: ((), None),  # one e8m0 exponent byte: see _random_blocks
}
_IQ1_M_SCALES = 48  # IQ1_M's four uint16 scale words; their top nibbles hold the fp16 super-scale
_FLOATS = frozenset({T.F32, T.F16, T.BF16})
_SAMPLE_BLOCKS = 4096
_CHUNK_BYTES = 1 << 28  # random bytes drawn at once
_JITTER_RMS = (13 / 12) ** 0.5  # of uniform(0.5, 1.5), divided out of the scales


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _set_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, d: np.ndarray, off: np.ndarray | None) -> None:
    """Store per-block scales ``d`` (and offsets ``off``) [n_blocks] in blocks [n_blocks, type_size]."""
    d_fields, off_field = _SCALE_FIELDS[qtype]
    for f in d_fields:
        blocks[:, f:f + 2] = _fp16_bytes(d)
    if off_field is not None:
        blocks[:, off_field:off_field + 2] = _fp16_bytes(off)
    if qtype == T.IQ1_M:  # fp16 bits 4k..4k+3 -> the top nibble of scale word k (high nibble of its 2nd byte)
        bits = d.astype(np.float16).view(np.uint16)
        for k in range(4):
            c = _IQ1_M_SCALES + 2 * k + 1
            blocks[:, c] = (blocks[:, c] & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)


def _sample_weights(qtype: GGMLQuantizationType, set_scales) -> np.ndarray:
    """Weights of _SAMPLE_BLOCKS random blocks whose scale fields ``set_scales(blocks)`` sets."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (_SAMPLE_BLOCKS, ts), dtype=np.uint8)
    set_scales(blocks)
    return dequantize(torch.from_numpy(blocks), qtype, (_SAMPLE_BLOCKS, bs)).numpy().astype(np.float64)


@cache
def _scales(qtype: GGMLQuantizationType, std: float) -> tuple[float, float]:
    """(d, offset) for weights of mean ~0 and standard deviation ~``std`` from random code bytes."""
    n = _SAMPLE_BLOCKS
    _, off_field = _SCALE_FIELDS[qtype]

    def weights(d: float, off: float) -> np.ndarray:
        return _sample_weights(qtype, lambda b: _set_scales(b, qtype, np.full(n, d), np.full(n, off)))

    off = 0.0
    if off_field is not None:  # w = d * f(codes) +/- off * g(codes): cancel the mean
        off = -weights(1.0, 0.0).mean() / weights(0.0, 1.0).mean()
    unit = weights(1.0, off).std() * _JITTER_RMS
    return std / unit, off * std / unit


@cache
def _e8m0_exponents(std: float) -> tuple[int, float]:
    """MXFP4: (e, p) such that exponent e, or e + 1 with probability p, gives weights of rms ``std``."""
    unit = _sample_weights(T.MXFP4, lambda b: b.__setitem__((slice(None), 0), 128)).std()  # 128: scale 1
    r = std / unit
    k = int(np.floor(np.log2(r)))
    e = int(np.clip(128 + k, 2, 253))  # (below 2 the exponent is not a plain power of two)
    # rms of 2^k (1 - p) and 2^(k+1) p: 2^k sqrt(1 + 3p)
    return e, float(np.clip(((r / 2.0 ** k) ** 2 - 1) / 3, 0, 1))


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                   std: float) -> np.ndarray:
    """Random ``qtype`` blocks for a tensor of ``shape`` (rows first), as uint8 [rows, row_bytes]."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    nb = rows * cols // bs
    out = np.empty(nb * ts, dtype=np.uint8)
    for i in range(0, out.size, _CHUNK_BYTES):
        n = min(_CHUNK_BYTES, out.size - i)
        out[i:i + n] = rng.integers(0, 256, n, dtype=np.uint8)
    blocks = out.reshape(nb, ts)
    # every block its own scale, so a kernel reading the wrong one shows
    if qtype == T.MXFP4:  # power-of-two scales: two neighbouring exponents, mixed to the target rms
        e, p = _e8m0_exponents(std)
        blocks[:, 0] = e + (rng.random(nb) < p)
        return blocks.reshape(rows, -1)
    d, off = _scales(qtype, std)
    jitter = rng.uniform(0.5, 1.5, nb)
    if _SCALE_FIELDS[qtype][1] is None:
        # either sign too: codes that do not average 0 (Q4_0's -8..7, IQ4_NL's table) then give weights that do
        jitter *= rng.choice(np.array([-1.0, 1.0]), nb)
    _set_scales(blocks, qtype, d * jitter, off * jitter)
    return blocks.reshape(rows, -1)


def _tensor_shapes(arch: str, hp: dict) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF name -> shape (rows first) of every tensor of a llama / qwen2 / qwen3 model, or of the
    mixtures of experts qwen3moe and llama with experts (Mixtral): a router and stacked
    [experts, rows, cols] expert matrices in place of the MLP."""
    if arch not in ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss", "deepseek2"):
        raise UnsupportedFeatureError(
            f"dummy GGUF files are written for llama, qwen2, qwen3, qwen3moe, gpt-oss and deepseek2, not {arch}")
    h, inter, v = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    n_exp = expert_count(hp)
    e_inter = hp.get("moe_intermediate_size") or inter
    nh = hp["num_attention_heads"]
    nkv = hp.get("num_key_value_heads") or nh
    hd = hp.get("head_dim") or h // nh
    out = [("token_embd.weight", (v, h)), ("output_norm.weight", (h,))]
    if not hp.get("tie_word_embeddings", False):
        out.append(("output.weight", (v, h)))
    rope = rope_parameters(hp)
    if arch == "llama" and (rope.get("rope_type") or "").lower() == "llama3":
        out.append(("rope_freqs.weight", (hd // 2,)))
    if arch == "deepseek2":
        return out + _deepseek_layers(hp)
    for i in range(hp["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (nh * hd, h)),
                (b + "attn_k.weight", (nkv * hd, h)), (b + "attn_v.weight", (nkv * hd, h)),
                (b + "attn_output.weight", (h, nh * hd)),
                (b + ("post_attention_norm" if arch == "gpt-oss" else "ffn_norm") + ".weight", (h,))]
        if n_exp:
            out += [(b + "ffn_gate_inp.weight", (n_exp, h)), (b + "ffn_gate_exps.weight", (n_exp, e_inter, h)),
                    (b + "ffn_up_exps.weight", (n_exp, e_inter, h)), (b + "ffn_down_exps.weight", (n_exp, h, e_inter))]
        else:
            out += [(b + "ffn_gate.weight", (inter, h)), (b + "ffn_up.weight", (inter, h)),
                    (b + "ffn_down.weight", (h, inter))]
        if arch == "gpt-oss":  # biases everywhere, the sinks
            out += [(b + f"attn_{p}.bias", (n,)) for p, n in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd),
                                                               ("output", h))]
            out += [(b + "attn_sinks.weight", (nh,)), (b + "ffn_gate_inp.bias", (n_exp,)),
                    (b + "ffn_gate_exps.bias", (n_exp, e_inter)), (b + "ffn_up_exps.bias", (n_exp, e_inter)),
                    (b + "ffn_down_exps.bias", (n_exp, h))]
        if arch == "qwen2":
            out += [(b + f"attn_{p}.bias", (n,)) for p, n in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd))]
        if arch in ("qwen3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
    return out


def _deepseek_layers(hp: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A deepseek2 file's layers as llama.cpp's converter writes them (gguf_writer's DeepSeek notes)."""
    h, nh, inter = hp["hidden_size"], hp["num_attention_heads"], hp["intermediate_size"]
    rank, rot, nope, v = hp["kv_lora_rank"], hp["qk_rope_head_dim"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    n_exp, e_inter, q_rank = hp["n_routed_experts"], hp["moe_intermediate_size"], hp.get("q_lora_rank")
    shared = e_inter * (hp.get("n_shared_experts") or 0)
    out = []
    for i in range(hp["num_hidden_layers"]):
        b = f"blk.{i}."
        if q_rank:
            out += [(b + "attn_q_a.weight", (q_rank, h)), (b + "attn_q_a_norm.weight", (q_rank,)),
                    (b + "attn_q_b.weight", (nh * (nope + rot), q_rank))]
        else:
            out.append((b + "attn_q.weight", (nh * (nope + rot), h)))
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_kv_a_mqa.weight", (rank + rot, h)),
                (b + "attn_kv_a_norm.weight", (rank,)), (b + "attn_k_b.weight", (nh, rank, nope)),
                (b + "attn_v_b.weight", (nh, v, rank)), (b + "attn_output.weight", (h, nh * v)),
                (b + "ffn_norm.weight", (h,))]
        if i < (hp.get("first_k_dense_replace") or 0):
            out += [(b + "ffn_gate.weight", (inter, h)), (b + "ffn_up.weight", (inter, h)),
                    (b + "ffn_down.weight", (h, inter))]
            continue
        out += [(b + "ffn_gate_inp.weight", (n_exp, h)), (b + "ffn_gate_exps.weight", (n_exp, e_inter, h)),
                (b + "ffn_up_exps.weight", (n_exp, e_inter, h)), (b + "ffn_down_exps.weight", (n_exp, h, e_inter))]
        if shared:
            out += [(b + "ffn_gate_shexp.weight", (shared, h)), (b + "ffn_up_shexp.weight", (shared, h)),
                    (b + "ffn_down_shexp.weight", (h, shared))]
        if hp.get("scoring_func") == "sigmoid" or "DeepseekV3ForCausalLM" in hp["architectures"]:
            out.append((b + "exp_probs_b.bias", (n_exp,)))
    return out


def write_dummy_gguf(out: str | os.PathLike, shape: str | dict = "llama3-8b", file_type: str = "Q4_K_M", *,
                     seed: int = 0, std: float = 0.02, pure: bool = False, layers: int | None = None,
                     progress=None) -> WriteResult:
    """Write a random-weight GGUF of ``shape`` (a name of ``pocketllm.core.shapes.SHAPES`` or a
    Hugging Face config dict) in ``file_type`` (llama.cpp's names: Q4_K_M, IQ2_XXS, ...) to ``out``.
    ``pure``: every quantizable tensor in the file type's main type (llama-quantize --pure), e.g.
    all MXFP4 with MXFP4_MOE, which gives dense models' tensors Q8_0. ``layers``: that many layers of
    the shape instead of all (the same layers' kernels in a smaller file, as llama-quantize would mix a
    model of that depth)."""
    from pocketllm.core.shapes import SHAPES

    t0 = time.perf_counter()
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
        name, hp = shape, dict(SHAPES[shape])
    else:
        name, hp = "dummy", dict(shape)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1; got {layers}")
        hp["num_hidden_layers"] = layers
    ft_name, ftype, _ = mixes.parse_file_type(file_type)
    arch = arch_of(hp)
    rope = rope_parameters(hp)
    tensors = sorted(_tensor_shapes(arch, hp), key=lambda t: mixes.layer_order(t[0]))
    n_head = hp["num_attention_heads"]
    types = mixes.tensor_types(tensors, ftype, n_layer=hp["num_hidden_layers"], n_head=n_head,
                               n_head_kv=hp.get("num_key_value_heads") or n_head,
                               n_expert=expert_count(hp), pure=pure)
    for t in set(types.values()) - _FLOATS - set(_SCALE_FIELDS):
        raise UnsupportedFeatureError(f"dummy GGUF files cannot hold {t.name} tensors")
    n_params = sum(int(np.prod(s)) for _, s in tensors)
    rng = np.random.default_rng(seed)
    out = Path(out)
    shapes = dict(tensors)

    def tensor_data(tname: str, qt: GGMLQuantizationType) -> np.ndarray:
        s = shapes[tname]
        if tname == "rope_freqs.weight":
            return llama3_rope_factors(hp, rope)
        if qt not in _FLOATS:
            return _random_blocks(rng, qt, s, std)
        # norms (1) and biases (0); matrices of the float file types: gaussian
        if len(s) == 1:
            data = np.full(s, 0.0 if tname.endswith(".bias") else 1.0, np.float32)
        else:
            data = rng.standard_normal(s, dtype=np.float32) * std
        if qt == T.BF16:  # bfloat16 bits, rounded to nearest by torch, as raw bytes
            return torch.from_numpy(data).bfloat16().view(torch.int16).numpy().view(np.uint8)
        return data.astype(np.float32 if qt == T.F32 else np.float16)

    tokenizer = write_file(out, arch, f"{name} (random weights)", hp, rope, hp["vocab_size"], ftype, n_params,
                           lambda w: minimal_vocab(hp["vocab_size"], w), tensors, types, tensor_data, progress)
    return WriteResult(out, ft_name, types, n_params, out.stat().st_size, time.perf_counter() - t0, tokenizer)
