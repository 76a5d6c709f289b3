"""Hugging Face safetensors model directory -> GGUF file, quantized (``pocketllm quantize``).

The file is what llama.cpp's ``convert_hf_to_gguf.py`` followed by ``llama-quantize`` would write: the
metadata keys of the converter for llama / qwen2 / qwen3 / gemma3, its tensor names, the Q/K row permutation
of ``llama``-arch rotary weights, Gemma's norm weights stored as 1 + w, Llama 3 rope scaling as a
``rope_freqs`` tensor, no ``output`` tensor when the embeddings are tied, the tokenizer, and the per-tensor
types of the requested file type (`pocketllm.quant.mixes`). It is the exact inverse of
`pocketllm.loaders.gguf_loader`, whose name tables it uses.

Tensors are read, converted and quantized one at a time and streamed to the file, so memory stays near the
largest tensor.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from pocketllm.config import sentence_transformers_pooling
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.loaders.gguf_loader import ARCHITECTURES, global_names, layer_names
from pocketllm.quant import mixes
from pocketllm.quant.quantize import SUPPORTED, quantize

logger = logging.getLogger(__name__)
T = GGMLQuantizationType

HF_TO_GGUF_ARCH = {**{hf: arch for arch, hf in ARCHITECTURES.items()}, "MixtralForCausalLM": "llama",
                   "DeepseekV3ForCausalLM": "deepseek2"}


@dataclass
class WriteResult:
    path: Path
    file_type: str
    tensor_types: dict[str, GGMLQuantizationType]
    n_params: int
    n_bytes: int
    seconds: float
    tokenizer: str  # what the vocabulary came from

    def type_mix(self) -> str:
        """How many tensors of each type, e.g. "F32 x66, Q4_K x193, Q6_K x33"."""
        counts = Counter(t.name for t in self.tensor_types.values())
        return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))


# ---- config ------------------------------------------------------------------------------------------------

def load_hparams(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigurationError(f"{model_dir} has no config.json; give a Hugging Face model directory")
    cfg = json.loads(path.read_text())
    return {**cfg, **(cfg.get("text_config") or {})}


def arch_of(hp: dict) -> str:
    archs = hp.get("architectures") or []
    for a in archs:
        if a in HF_TO_GGUF_ARCH:
            return HF_TO_GGUF_ARCH[a]
    raise UnsupportedFeatureError(
        f"cannot quantize architecture {archs}; supported: {', '.join(sorted(HF_TO_GGUF_ARCH))}")


def rope_parameters(hp: dict) -> dict:
    """The converter's TextModel.__init__ normalisation of rope settings (flat or per attention type)."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        local = next((hp[k] for k in ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                                      "rope_local_base_freq") if hp.get(k) is not None), None)
        theta = next((hp[k] for k in ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                                      "rotary_emb_base") if hp.get(k) is not None), None)
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        if "original_max_position_embeddings" not in rope and hp.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = hp["original_max_position_embeddings"]
    return rope


def expert_count(hp: dict) -> int:
    """Experts per mixture-of-experts layer (Qwen3-MoE's key or Mixtral's / gpt-oss's); 0: dense."""
    return hp.get("num_experts") or hp.get("num_local_experts") or hp.get("n_routed_experts") or 0


def _head_dim(hp: dict) -> int:
    return hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]


def llama3_rope_factors(hp: dict, rope: dict) -> np.ndarray:
    """The converter's rope_freqs tensor for Llama 3 rope scaling: a divisor per frequency."""
    base = rope.get("rope_theta", 10000.0)
    dim = _head_dim(hp)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_arch_metadata(w: gguf.GGUFWriter, arch: str, hp: dict, rope: dict, vocab_size: int) -> None:
    """The keys convert_hf_to_gguf.py writes for these architectures."""
    gemma = arch == "gemma3"
    n_head = hp.get("num_attention_heads", 8 if gemma else None)
    w.add_block_count(hp["num_hidden_layers"])
    if hp.get("_pooling"):  # an embedding model (sentence-transformers' Pooling), as convert_hf_to_gguf.py marks it
        w.add_pooling_type(gguf.PoolingType[hp["_pooling"].upper()])
    if arch == "bert":  # an encoder: learned positions, LayerNorm, attention both ways
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(n_head)
        w.add_layer_norm_eps(hp.get("layer_norm_eps", 1e-12))
        w.add_causal_attention(False)
        w.add_vocab_size(vocab_size)
        w.add_token_type_count(hp.get("type_vocab_size", 2))  # (llama.cpp refuses a BERT file without it)
        if not hp.get("_pooling"):
            w.add_pooling_type(gguf.PoolingType.CLS)  # (the converter's default for BERT)
        return
    w.add_context_length(hp.get("max_position_embeddings") or (131072 if gemma else 2048))
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    # (DeepSeek's latent attention: one KV head of kv_lora_rank + rope values, as the converter writes it)
    w.add_head_count_kv(1 if arch == "deepseek2" else hp.get("num_key_value_heads") or (4 if gemma else n_head))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    if arch == "deepseek2":
        _add_deepseek_metadata(w, hp, rope)
    elif hp.get("head_dim") is not None or gemma:
        w.add_key_length(hp.get("head_dim") or 256)
        w.add_value_length(hp.get("head_dim") or 256)
    full = rope.get("full_attention", rope)
    theta = full.get("rope_theta")
    if theta is None and gemma:
        theta = 1_000_000.0
    if theta is not None:
        w.add_rope_freq_base(float(theta))
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(float(local))
    kind = (full.get("rope_type") or "default").lower()
    factor = full.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if full.get(key) is not None:
                add(full[key])
        if (attn := full.get("attention_factor", full.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
    elif kind == "llama3":
        if arch != "llama":
            raise UnsupportedFeatureError(f"llama3 rope scaling on {arch} has no GGUF form")
    elif kind != "default":
        raise UnsupportedFeatureError(f"rope scaling {kind!r} cannot be written to GGUF by pocketllm")
    w.add_vocab_size(vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(_head_dim(hp))
    if n_expert := expert_count(hp):
        w.add_expert_count(n_expert)
        w.add_expert_used_count(hp["num_experts_per_tok"])
        if hp.get("moe_intermediate_size") or arch == "gpt-oss":
            w.add_expert_feed_forward_length(hp.get("moe_intermediate_size") or hp["intermediate_size"])
    if arch == "gpt-oss":
        # llama.cpp fixes the clamped SwiGLU's constants for gpt-oss files; nothing records others
        if (hp.get("swiglu_limit", 7.0), hp.get("swiglu_alpha", 1.702)) != (7.0, 1.702):
            raise UnsupportedFeatureError("gpt-oss GGUF files hold swiglu_limit 7.0 and swiglu_alpha 1.702 only")
        w.add_sliding_window(hp["sliding_window"])
    if gemma:
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1 and hp.get("sliding_window"):
            w.add_sliding_window(hp["sliding_window"])
            # llama.cpp assumes every 6th layer global unless told; say so when the config differs
            types = hp.get("layer_types")
            if types:
                swa = [t == "sliding_attention" for t in types]
                if swa != [i % 6 < 5 for i in range(len(types))]:
                    w.add_sliding_window_pattern(swa)


def _add_deepseek_metadata(w: gguf.GGUFWriter, hp: dict, rope: dict) -> None:
    """What convert_hf_to_gguf.py's DeepseekV2Model writes: multi-head latent attention as one KV head of
    kv_lora_rank + rope values, the shared experts and the routing."""
    rank, rot = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_kv_lora_rank(rank)
    if hp.get("q_lora_rank"):
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_key_length(rank + rot)
    w.add_value_length(rank)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + rot)
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_rope_dimension_count(rot)
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace") or 0)
    w.add_expert_shared_count(hp.get("n_shared_experts") or 0)
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    sigmoid = "DeepseekV3ForCausalLM" in (hp.get("architectures") or []) or hp.get("scoring_func") == "sigmoid"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if (mscale_all := rope.get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)  # (the converter's legacy form: 0.1 * mscale_all_dim)


# ---- tokenizer ---------------------------------------------------------------------------------------------

# sha256 of str(ids) of convert_hf_to_gguf's check text -> tokenizer.ggml.pre (from its get_vocab_base_pre,
# restricted to the names pocketllm's GGUF tokenizer reads)
_CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
           '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
           '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
           '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
_PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # o200k: GPT-4o, gpt-oss
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869": "kanana2",
    "f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af": "talkie",
}
# tokenizers' ByteLevel(use_regex=True) split, as llama.cpp spells it
_BYTE_LEVEL_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _pre_tokenizer_regexes(pre: dict | None) -> tuple[str, ...] | None:
    """The splitting regexes of a tokenizer.json pre_tokenizer, in llama.cpp's terms; None if it does
    something else."""
    if pre is None:
        return ()
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and "Regex" in (step.get("pattern") or {}) and step.get("behavior") == "Isolated" \
                and not step.get("invert"):
            out.append(step["pattern"]["Regex"])
        elif kind == "Digits":
            out.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        elif kind == "ByteLevel":
            if step.get("use_regex", True):
                out.append(_BYTE_LEVEL_REGEX)
        else:
            return None
    return tuple(out)


def pre_tokenizer_name(tokenizer_json: dict, backend) -> str:
    """tokenizer.ggml.pre for a byte-level BPE tokenizer: by the converter's hash of a check text, else by
    the pre-tokenizer's regexes, else "default"."""
    from pocketllm.tokenizer.gguf_pre import PRE_TOKENIZERS

    try:
        chkhsh = sha256(str(backend.encode(_CHKTXT).ids).encode()).hexdigest()
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot encode the text is matched by regex
        logger.debug("no check-text hash (%s); matching the pre-tokenizer by its regexes", e)
    else:
        if chkhsh in _PRE_BY_HASH:
            return _PRE_BY_HASH[chkhsh]
    regexes = _pre_tokenizer_regexes(tokenizer_json.get("pre_tokenizer"))
    ignore_merges = bool(tokenizer_json.get("model", {}).get("ignore_merges", False))
    if regexes:
        for name, pre in PRE_TOKENIZERS.items():
            if name != "default" and pre.regexes == regexes and pre.ignore_merges == ignore_merges:
                return name
    logger.warning("unknown pre-tokenizer %s; writing tokenizer.ggml.pre = default",
                   json.dumps(tokenizer_json.get("pre_tokenizer"))[:200])
    return "default"


def _looks_special(token: str) -> bool:
    """The converter's does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _byte_level_vocab(model_dir: Path, vocab_size: int, w: gguf.GGUFWriter, arch: str) -> str:
    """gpt2-style vocabulary from tokenizer.json (the converter's _set_vocab_gpt2 / get_vocab_base)."""
    from tokenizers import Tokenizer

    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = backend.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= vocab_size:
        raise ConfigurationError(f"the tokenizer has ids up to {max(vocab.values())} but the model's vocab_size "
                                 f"is {vocab_size}")
    added = backend.get_added_tokens_decoder()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if added[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    pre = pre_tokenizer_name(tj, backend)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True)
    if arch == "llama" and vocab_size == 49152:
        special.add_special_token["bos"] = False  # the converter's rule for these (Granite / SmolLM) vocabularies
    special.add_to_gguf(w, quiet=True)
    return f"tokenizer.json (gpt2, pre {pre})"


def _read_sentencepiece(path: Path) -> tuple[list[str], list[float], list[int], bool]:
    """Pieces, scores and types of a SentencePiece tokenizer.model (a protobuf ModelProto), and its
    normalizer's add_dummy_prefix, without the sentencepiece package."""
    data = path.read_bytes()

    def varint(buf, pos):
        out = shift = 0
        while True:
            b = buf[pos]
            pos += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return out, pos

    def fields(buf):
        pos = 0
        while pos < len(buf):
            key, pos = varint(buf, pos)
            num, wire = key >> 3, key & 7
            if wire == 0:
                val, pos = varint(buf, pos)
            elif wire == 1:
                val, pos = buf[pos:pos + 8], pos + 8
            elif wire == 2:
                n, pos = varint(buf, pos)
                val, pos = buf[pos:pos + n], pos + n
            elif wire == 5:
                val, pos = buf[pos:pos + 4], pos + 4
            else:
                raise ConfigurationError(f"{path} is not a SentencePiece model (wire type {wire})")
            yield num, val

    pieces, scores, types, add_dummy_prefix = [], [], [], True
    for num, val in fields(data):
        if num == 1:  # SentencePiece
            piece, score, kind = "", 0.0, 1
            for n, v in fields(val):
                if n == 1:
                    piece = bytes(v).decode("utf-8")
                elif n == 2:
                    score = float(np.frombuffer(bytes(v), dtype="<f4")[0])
                elif n == 3:
                    kind = v
            pieces.append(piece)
            scores.append(score)
            types.append(kind)  # sentencepiece's NORMAL..BYTE = 1..6, the same numbers as gguf.TokenType
        elif num == 3:  # NormalizerSpec
            for n, v in fields(val):
                if n == 3:
                    add_dummy_prefix = bool(v)
    return pieces, scores, types, add_dummy_prefix


def _sentencepiece_vocab(model_dir: Path, vocab_size: int, w: gguf.GGUFWriter, arch: str) -> str:
    """llama-style vocabulary from tokenizer.model (the converter's _create_vocab_sentencepiece)."""
    pieces, piece_scores, piece_types, _ = _read_sentencepiece(model_dir / "tokenizer.model")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for i, (p, s, k) in enumerate(zip(pieces, piece_scores, piece_types)):
        if i >= vocab_size:
            break
        tokens[i], scores[i], types[i] = p, s, k
    if (model_dir / "added_tokens.json").is_file():
        for text, i in json.loads((model_dir / "added_tokens.json").read_text(encoding="utf-8")).items():
            if i < vocab_size:
                tokens[i], scores[i], types[i] = text, -1000.0, int(gguf.TokenType.USER_DEFINED)
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        decoder = json.loads(cfg_path.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        for key, data in decoder.items():
            i, text = int(key), data["content"]
            if i >= vocab_size:
                continue
            if data.get("special") or _looks_special(text):
                types[i] = int(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[i] = int(gguf.TokenType.USER_DEFINED)
            tokens[i], scores[i] = text, -1000.0
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    if arch == "gemma3":
        w.add_add_space_prefix(False)
    else:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        if cfg.get("add_prefix_space") is not None:
            w.add_add_space_prefix(cfg["add_prefix_space"])
    return "tokenizer.model (llama / SentencePiece)"


def minimal_vocab(vocab_size: int, w: gguf.GGUFWriter) -> str:
    """A directory without a tokenizer still gets a loadable one: GPT-2's 256 byte tokens, one merge (two
    spaces), the rest unused. Enough for token-id prompts and byte-level text; not the model's real vocabulary."""
    if vocab_size < 257:
        raise ConfigurationError("the model directory has no tokenizer.json or tokenizer.model, and the "
                                 f"vocabulary ({vocab_size}) is too small for a byte-level stand-in")
    byte_chars = _gpt2_byte_chars()
    tokens = byte_chars + ["\u0120\u0120"] + [f"[PAD{i}]" for i in range(257, vocab_size)]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.UNUSED] * (vocab_size - 257)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 \u0120"])
    return "none in the directory: a byte-level stand-in vocabulary"


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int, arch: str) -> str:
    if (model_dir / "tokenizer.model").is_file() and (arch == "gemma3" or not (model_dir / "tokenizer.json").is_file()
                                                        or _is_sentencepiece_json(model_dir)):
        return _sentencepiece_vocab(model_dir, vocab_size, w, arch)
    if (model_dir / "tokenizer.json").is_file() and arch == "bert":
        return wordpiece_vocab(model_dir, w)
    if (model_dir / "tokenizer.json").is_file():
        if _is_sentencepiece_json(model_dir):
            raise UnsupportedFeatureError(
                "this tokenizer.json is a SentencePiece-style BPE (byte fallback); writing it needs the "
                "directory's tokenizer.model")
        return _byte_level_vocab(model_dir, vocab_size, w, arch)
    logger.warning("%s has no tokenizer; writing a byte-level stand-in vocabulary", model_dir)
    return minimal_vocab(vocab_size, w)


def wordpiece_vocab(model_dir: Path, w: gguf.GGUFWriter) -> str:
    """A WordPiece tokenizer.json as llama.cpp's BERT vocabulary ("bert"): a word-initial piece written with
    a leading "▁", a continuing "##piece" bare, bracketed special tokens as they are."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if spec.get("model", {}).get("type") != "WordPiece":
        raise UnsupportedFeatureError("a BERT model's tokenizer.json must be WordPiece to be written to GGUF")
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens, types = [], []
    for i in range(len(by_id)):
        t = by_id[i]
        special_or_bracketed = t in special or (t.startswith("[") and t.endswith("]"))
        tokens.append(t if special_or_bracketed else t[2:] if t.startswith("##") else "\u2581" + t)
        types.append(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, add in (("[CLS]", w.add_bos_token_id), ("[SEP]", w.add_sep_token_id), ("[UNK]", w.add_unk_token_id),
                      ("[PAD]", w.add_pad_token_id), ("[MASK]", w.add_mask_token_id)):
        if name in spec["model"]["vocab"]:
            add(spec["model"]["vocab"][name])
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    return "tokenizer.json (WordPiece)"


def _is_sentencepiece_json(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    return bool(model.get("byte_fallback")) or model.get("type") == "Unigram"


# ---- tensors -----------------------------------------------------------------------------------------------

_HF_GLOBAL = {arch: {hf: g for g, hf in global_names(arch).items()} for arch in ARCHITECTURES}
_HF_LAYER = {arch: {hf: g for g, hf in layer_names(arch).items()} for arch in ARCHITECTURES}
_HF_BLOCK = re.compile(r"^(?:model\.layers|encoder\.layer)\.(\d+)\.(.+)\.(weight|bias)$")
# one expert's matrix (Qwen3-MoE's names, Mixtral's): stacked into blk.N.ffn_*_exps
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_STEM = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_SKIP = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias", "embeddings.position_ids")


def gguf_name(hf: str, arch: str) -> str | None:
    """GGUF tensor name of a Hugging Face one (the inverse of GGUFModelFile.hf_name); None to skip it."""
    if hf.endswith(_SKIP) or hf.startswith("pooler."):  # (BERT's pooler: not an embedding model's output)
        return None
    stem, _, kind = hf.rpartition(".")
    if stem in _HF_GLOBAL[arch]:
        return f"{_HF_GLOBAL[arch][stem]}.{kind}"
    if hf.endswith(".sinks"):  # gpt-oss's: a bare parameter
        hf += ".weight"
    hf = hf.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    m = _HF_BLOCK.match(hf.replace(".e_score_correction_bias", ".e_score_correction.bias"))
    if m and m.group(2) in _HF_LAYER[arch]:
        return f"blk.{m.group(1)}.{_HF_LAYER[arch][m.group(2)]}.{m.group(3)}"
    raise UnsupportedFeatureError(f"unexpected tensor {hf!r} for architecture {arch!r}")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's `permute` of llama Q/K rows (rotate-half halves -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


def _collect_tensors(model_dir: Path, arch: str, hp: dict) -> list[_Tensor]:
    from safetensors import safe_open

    from pocketllm.loaders.safetensors_loader import safetensors_files

    tied = arch == "gemma3" or bool(hp.get("tie_word_embeddings", False))  # the converter drops Gemma's lm_head
    n_head = hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads") or n_head
    gemma = arch == "gemma3"
    out: list[_Tensor] = []
    experts: dict[str, dict[int, tuple]] = {}  # stacked name -> expert -> (file, tensor, shape)
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if hf == "lm_head.weight" and tied:
                    continue  # llama.cpp uses token_embd for the output
                if arch == "gpt-oss" and (fused := _GPT_OSS_EXPERTS.match(hf)):
                    out += _gpt_oss_experts(path, hf, fused, tuple(f.get_slice(hf).get_shape()))
                    continue
                if m := _HF_EXPERT.match(hf):
                    stacked = f"blk.{m.group(1)}.{_EXPERT_STEM[m.group(3)]}.weight"
                    experts.setdefault(stacked, {})[int(m.group(2))] = (path, hf, tuple(f.get_slice(hf).get_shape()))
                    continue
                if arch == "deepseek2" and hf.endswith("kv_b_proj.weight"):
                    out += _kv_b_halves(path, hf, hp)
                    continue
                if arch == "deepseek2" and _is_mtp_layer(hf, hp):
                    continue  # (the next-token-prediction layers: llama.cpp's converter leaves them out)
                name = gguf_name(hf, arch)
                if name is None:
                    continue
                shape = tuple(f.get_slice(hf).get_shape())

                def load(path=path, hf=hf, name=name):
                    data = _read_tensor(path, hf)
                    if arch == "llama" and re.search(r"\.attn_[qk]\.", name):
                        data = permute_rows(data, n_head if ".attn_q." in name else n_kv)
                    if gemma and hf.endswith("norm.weight"):
                        data = data + 1.0  # Gemma3RMSNorm computes x * (1 + w); llama.cpp stores 1 + w
                    return np.ascontiguousarray(data, dtype=np.float32)

                out.append(_Tensor(name, shape, load))
    for name, parts in experts.items():
        if sorted(parts) != list(range(len(parts))):
            raise ConfigurationError(f"{model_dir}: experts of {name} are missing")

        def load_experts(parts=parts):
            return np.stack([_read_tensor(*parts[e][:2]) for e in range(len(parts))])

        out.append(_Tensor(name, (len(parts), *parts[0][2]), load_experts))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"{model_dir} holds some tensors twice")
    rope = rope_parameters(hp)
    if arch == "llama" and (rope.get("full_attention", rope).get("rope_type") or "").lower() == "llama3":
        factors = llama3_rope_factors(hp, rope.get("full_attention", rope))
        out.append(_Tensor("rope_freqs.weight", factors.shape, lambda: factors))
    return out


def _kv_b_halves(path: Path, hf: str, hp: dict) -> list[_Tensor]:
    """The converter's split of DeepSeek's kv_b_proj [H * (nope + v), rank] for its absorbed attention:
    attn_k_b [H, rank, nope] (each head's W_UK, transposed) and attn_v_b [H, v, rank]."""
    layer = re.match(r"^model\.layers\.(\d+)\.", hf).group(1)
    h, nope, v, rank = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"], hp["kv_lora_rank"]

    def half(k: bool) -> np.ndarray:
        kv_b = _read_tensor(path, hf).reshape(h, nope + v, rank)
        return np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1) if k else kv_b[:, nope:])

    return [_Tensor(f"blk.{layer}.attn_k_b.weight", (h, rank, nope), lambda: half(True)),
            _Tensor(f"blk.{layer}.attn_v_b.weight", (h, v, rank), lambda: half(False))]


def _is_mtp_layer(hf: str, hp: dict) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.", hf)
    return m is not None and int(m.group(1)) >= hp["num_hidden_layers"]


# gpt-oss's fused experts, x @ W style, gate and up interleaved (models/gpt_oss.py)
_GPT_OSS_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def _gpt_oss_experts(path: Path, hf: str, m: re.Match, shape: tuple[int, ...]) -> list[_Tensor]:
    """llama.cpp's converter's split: gate_up [E, H, 2I] -> ffn_gate_exps / ffn_up_exps [E, I, H]
    (columns 0::2 / 1::2, transposed), down [E, I, H] -> ffn_down_exps [E, H, I]; biases alike."""
    b, proj, bias = f"blk.{m.group(1)}.", m.group(2), bool(m.group(3))
    kind = "bias" if bias else "weight"
    if proj == "down_proj":
        return [_Tensor(f"{b}ffn_down_exps.{kind}", shape if bias else (shape[0], shape[2], shape[1]),
                        lambda: np.ascontiguousarray(_read_tensor(path, hf) if bias else
                                                     _read_tensor(path, hf).transpose(0, 2, 1)))]
    out = []
    for stem, cols in (("ffn_gate_exps", slice(0, None, 2)), ("ffn_up_exps", slice(1, None, 2))):
        half = (shape[0], shape[1] // 2) if bias else (shape[0], shape[2] // 2, shape[1])

        def load(cols=cols):  # only its half of the columns read
            t = _read_tensor(path, hf, (slice(None), cols) if bias else (slice(None), slice(None), cols))
            return np.ascontiguousarray(t if bias else t.transpose(0, 2, 1))

        out.append(_Tensor(f"{b}{stem}.{kind}", half, load))
    return out


def _read_tensor(path: Path, name: str, index: tuple | None = None) -> np.ndarray:
    """One safetensors tensor (or its ``index`` slice) as float32."""
    import torch

    t = _open(path).get_tensor(name) if index is None else _open(path).get_slice(name)[index]
    return t.to(torch.float32).numpy()


@functools.lru_cache(maxsize=8)
def _open(path: Path):
    """A safetensors file's handle, kept open while its tensors are read (one per expert matrix)."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def _size_label(n_params: int) -> str:
    return gguf.size_label(n_params, 0, 0, 0)


def write_gguf(src: str | os.PathLike, out: str | os.PathLike, file_type: str = "Q8_0", *, pure: bool = False,
               output_type: str | GGMLQuantizationType | None = None,
               token_embedding_type: str | GGMLQuantizationType | None = None,
               name: str | None = None, progress: Callable[[str], None] | None = None) -> WriteResult:
    """Quantize the Hugging Face model directory `src` into the GGUF file `out`.

    `file_type`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K,
    IQ4_NL, IQ4_XS (Q3_K, Q4_K, Q5_K mean the _M mixes, as in llama-quantize). `pure`: no mix, every
    quantizable tensor gets the main type (with llama.cpp's fallbacks for rows that do not fit its blocks)."""
    t0 = time.perf_counter()
    model_dir, out = Path(src), Path(out)
    if not model_dir.is_dir():
        raise ConfigurationError(f"{model_dir} is not a directory; give a Hugging Face model directory")
    ft_name, ftype, _ = mixes.parse_file_type(file_type)
    hp = load_hparams(model_dir)
    hp["_pooling"] = sentence_transformers_pooling(model_dir)[0]
    arch = arch_of(hp)
    rope = rope_parameters(hp)
    _open.cache_clear()  # handles of an earlier file at these paths
    tensors = _collect_tensors(model_dir, arch, hp)
    vocab_size = hp.get("vocab_size") or next(t.shape[0] for t in tensors if t.name == "token_embd.weight")
    n_head = hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads") or n_head
    n_layer = hp["num_hidden_layers"]
    is_70b = n_layer == 80 and (arch == "qwen2" or (arch == "llama" and n_head != n_kv))
    types = mixes.tensor_types([(t.name, t.shape) for t in tensors], ftype, n_layer=n_layer, n_head=n_head,
                               n_head_kv=n_kv, n_expert=expert_count(hp),
                               is_70b=is_70b, pure=pure, output_type=_ggml_type(output_type),
                               token_embedding_type=_ggml_type(token_embedding_type))
    missing = sorted({t.name for t in types.values()} - {t.name for t in SUPPORTED})
    if missing:  # the lattice i-quants and MXFP4: before any tensor is read
        raise UnsupportedFeatureError(f"{ft_name} files hold {', '.join(missing)} tensors, which pocketllm cannot "
                                      f"quantize (`pocketllm dummy-gguf` writes random-weight files of any type)")
    # llama-quantize's order: global tensors by name, then block by block
    tensors.sort(key=lambda t: mixes.layer_order(t.name))
    n_params = sum(int(np.prod(t.shape)) for t in tensors)

    by_name = {t.name: t for t in tensors}
    tokenizer = write_file(
        out, arch, name or Path(hp.get("_name_or_path") or model_dir.name).name or model_dir.name, hp, rope,
        vocab_size, ftype, n_params, lambda w: add_tokenizer(w, model_dir, vocab_size, arch),
        [(t.name, t.shape) for t in tensors], types, lambda tname, qt: _encode(by_name[tname].load(), qt), progress)
    _open.cache_clear()  # the next file at these paths may be another
    return WriteResult(out, ft_name, types, n_params, out.stat().st_size, time.perf_counter() - t0, tokenizer)


def write_file(out: Path, arch: str, name: str, hp: dict, rope: dict | None, vocab_size: int, ftype: int,
               n_params: int, add_vocab: Callable[[gguf.GGUFWriter], str], tensors: list[tuple[str, tuple]],
               types: dict[str, GGMLQuantizationType],
               tensor_data: Callable[[str, GGMLQuantizationType], np.ndarray],
               progress: Callable[[str], None] | None) -> str:
    """Write a GGUF file: the model's metadata, the vocabulary (``add_vocab`` returns what it came
    from, returned here), the tensors' infos, then each tensor's data, in order, as ``tensor_data``
    makes it (F32 / F16 as floats, every other type as raw bytes of whole blocks per row). The file
    is written as ``out.partial`` and renamed when complete; on any error it is removed."""
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch)
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        w.add_size_label(_size_label(n_params))
        _add_arch_metadata(w, arch, hp, rope, vocab_size)
        w.add_file_type(ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tokenizer = add_vocab(w)
        for tname, shape in tensors:
            qt = types[tname]
            if qt in (T.F32, T.F16):
                dtype = np.float32 if qt == T.F32 else np.float16
                w.add_tensor_info(tname, shape, dtype, int(np.prod(shape)) * np.dtype(dtype).itemsize)
            else:  # byte shape: whole blocks per row
                byte_shape = (*shape[:-1], _row_bytes(qt, shape[-1]))
                w.add_tensor_info(tname, byte_shape, np.uint8, int(np.prod(byte_shape)), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (tname, shape) in enumerate(tensors):
            qt = types[tname]
            if progress:
                progress(f"[{i + 1}/{len(tensors)}] {tname:32s} {list(shape)!s:16s} -> {qt.name}")
            w.write_tensor_data(tensor_data(tname, qt))
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return tokenizer


def _ggml_type(t: str | GGMLQuantizationType | None) -> GGMLQuantizationType | None:
    if t is None:
        return None
    qt = T[t.strip().upper()] if isinstance(t, str) and t.strip().upper() in T.__members__ else None
    qt = T(t) if not isinstance(t, str) else qt
    if qt not in SUPPORTED:
        raise ValueError(f"cannot write tensors of type {t!r}; choose one of: {', '.join(x.name for x in SUPPORTED)}")
    return qt


def _row_bytes(qt: GGMLQuantizationType, k: int) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    return k // bs * ts


def _encode(data: np.ndarray, qt: GGMLQuantizationType) -> np.ndarray:
    if qt == T.F32:
        return data.astype(np.float32)
    if qt == T.F16:
        return data.astype(np.float16)
    return quantize(data.reshape(-1, data.shape[-1]), qt)
