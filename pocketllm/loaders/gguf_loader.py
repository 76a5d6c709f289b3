"""GGUF model files (llama.cpp's format): metadata -> ModelConfig, tensors -> the same runtimes
as safetensors, memory-mapped and kept in their quantized encoding.

What llama.cpp's converter changed is undone here: tensor names, the Q/K row permutation of
`llama`-arch rotary weights, Gemma's +1 folded into its norm weights.
"""
from __future__ import annotations

import gc
import mmap
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pocketllm.config import ModelConfig
from pocketllm.errors import ConfigurationError, UnsupportedFeatureError
from pocketllm.gguf_file import GGUFFile, split_name
from pocketllm.layers.linear import QuantizedTensor

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "bert": "BertModel",
    "nomic-bert": "NomicBertModel",
    "deepseek2": "DeepseekV2ForCausalLM",  # (V3's routing: DeepseekV3ForCausalLM, by its gating function)
}

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# The experts' stacked [n_expert, rows, cols] tensors: expert e's matrix is mlp.experts.{e}.<proj>
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def _expert_layer(name: str) -> int | None:
    """The layer of a stacked experts tensor (blk.N.ffn_*_exps.*), else None."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[2] in EXPERT_NAMES else None
# Gemma 3 has four norms per layer; llama.cpp names them differently.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: its post-attention norm under llama.cpp's ATTN_POST_NORM name, and the sinks
_GPT_OSS_LAYER_NAMES = {**{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
                        "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}


# BERT: its embeddings' three tables and norm, and post-norm encoder blocks under encoder.layer.N
_BERT_GLOBAL_NAMES = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
                      "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
_BERT_LAYER_NAMES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                     "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                     "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}


# Nomic BERT: BERT's module tree (pocketllm.models.bert) with one QKV matrix and a gated MLP
_NOMIC_LAYER_NAMES = {**{k: v for k, v in _BERT_LAYER_NAMES.items() if k not in ("attn_q", "attn_k", "attn_v")},
                      "attn_qkv": "attention.self.qkv", "ffn_gate": "intermediate.gate"}
_ENCODERS = ("bert", "nomic-bert")

# DeepSeek-V2/V3: multi-head latent attention's projections, the router's score correction and the shared
# experts. llama.cpp writes kv_b_proj split in two for its absorbed attention: attn_k_b (each head's W_UK,
# transposed) and attn_v_b, which the loader joins back into kv_b_proj (older files: attn_kv_b), dense: the
# runtime reads its weight as W_UK and W_UV, not through the layer.
_DEEPSEEK_LAYER_NAMES = {**_LAYER_NAMES,
                         "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                         "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                         "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                         "exp_probs_b": "mlp.gate.e_score_correction",  # (.bias: transformers' e_score_correction_bias)
                         "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                         "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_KV_B_HALVES = ("attn_k_b", "attn_v_b")
# llama.cpp's expert_gating_func: 1 softmax (V2), 2 sigmoid (V3)
_SIGMOID_GATING = 2


def layer_names(arch: str) -> dict[str, str]:
    """GGUF per-layer tensor stem -> the Hugging Face module path, for ``arch``."""
    return {"gemma3": _GEMMA3_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES, "bert": _BERT_LAYER_NAMES,
            "nomic-bert": _NOMIC_LAYER_NAMES, "deepseek2": _DEEPSEEK_LAYER_NAMES}.get(arch, _LAYER_NAMES)


def global_names(arch: str) -> dict[str, str]:
    """GGUF tensor stems outside the blocks -> the Hugging Face module path, for ``arch``."""
    return _BERT_GLOBAL_NAMES if arch in _ENCODERS else GLOBAL_NAMES


def block_prefix(arch: str) -> str:
    """The Hugging Face prefix of layer N's modules (``{}``: N)."""
    return "encoder.layer.{}" if arch in _ENCODERS else "model.layers.{}"
# llama.cpp's pooling_type: 0 none (a generative model), 1 mean, 2 cls, 3 last (4, rank, is a reranker's)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_DENSE = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def split_parts(first: Path, count: int) -> list[Path]:
    """The files of a model split by llama.cpp's gguf-split (`NAME-00001-of-0000N.gguf`), `first` the first."""
    if count <= 1:
        return [first]
    split = split_name(first.name)
    if split is None or split[1:] != (1, count):
        raise ConfigurationError(f"{first.name} is part of a model split in {count} files: give its first part, "
                                 "named NAME-00001-of-000NN.gguf")
    parts = [first.with_name(f"{split[0]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ConfigurationError(f"{first.name} is split in {count} files; missing beside it: {', '.join(missing)}")
    return parts


class GGUFModelFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFFile(self.path)  # (a split file's first part: the metadata)
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedFeatureError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
        self.parts = [self.reader] + [GGUFFile(p) for p in split_parts(self.path, self.meta("split.count", 1))[1:]]
        # every tensor of every part, in file order, with the part that holds it
        self.all_tensors = [(t, part) for part in self.parts for t in part.tensors]
        self.tensors = {t.name: t for t, _ in self.all_tensors}
        self._config: ModelConfig | None = None  # read once: the loader and the engine both need it

    def meta(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_meta(self, key: str, default=None):
        return self.meta(f"{self.arch}.{key}", default)

    def quant_types(self) -> set[str]:
        return {t.tensor_type.name for t in self.tensors.values() if len(t.shape) > 1}

    def held_bytes(self, kept: frozenset[str], dense_bytes: int, layers: frozenset[int] | None = None,
                   experts_only: bool = False) -> int:
        """The weights' bytes in memory: the file's blocks for the types in `kept`, `dense_bytes` a
        weight for the others (dequantized at load); `experts_only`: only the experts of `layers`."""
        return sum(int(t.n_bytes) if t.tensor_type.name in kept else int(t.n_elements) * dense_bytes
                   for t in self.tensors.values() if not experts_only or _expert_layer(t.name) in layers)

    def expert_layers(self, cpu_offload_experts: str | None) -> frozenset[int]:
        """The layers whose experts `cpu_offload_experts` (N, or "all") puts in host memory: the first N
        with a router."""
        if cpu_offload_experts is None:
            return frozenset()
        routed = sorted(int(name.split(".")[1]) for name in self.tensors if name.endswith("ffn_gate_inp.weight"))
        return frozenset(routed if cpu_offload_experts == "all" else routed[:int(cpu_offload_experts)])

    def model_config(self) -> ModelConfig:
        if self._config is None:
            self._config = self._read_config()
        return self._config

    def _read_config(self) -> ModelConfig:
        heads = self.arch_meta("attention.head_count")
        hidden = self.arch_meta("embedding_length")
        vocab = self.arch_meta("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = [self.meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        raw = {k: f.contents() for k, f in self.reader.fields.items()
               if k.startswith(f"{self.arch}.") and len(f.data) < 64}
        if self.arch == "gemma3":
            raw.update(self._gemma3_settings(self.arch_meta("attention.key_length", hidden // heads)))
        if self.arch in _ENCODERS:  # the keys the encoder reads, under transformers' names
            raw.update(layer_norm_eps=self.arch_meta("attention.layer_norm_epsilon", 1e-12),
                       type_vocab_size=int(self.tensors["token_types.weight"].shape[-1]))
        if self.arch == "gpt-oss":  # sliding-window layers: even ones unless a pattern says otherwise
            raw["sliding_window"] = self.arch_meta("attention.sliding_window")
            if isinstance(pattern := self.arch_meta("attention.sliding_window_pattern"), list):
                raw["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        if self.arch == "deepseek2":
            raw.update(self._deepseek_settings())
        experts = self.arch_meta("expert_count", 0)
        if experts:  # layers without a router keep a dense MLP
            raw["mlp_only_layers"] = [i for i in range(self.arch_meta("block_count"))
                                      if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors]
        architecture = ARCHITECTURES[self.arch]
        if self.arch == "llama" and experts:  # llama.cpp writes Mixtral as `llama` with expert tensors
            architecture = "MixtralForCausalLM"
        elif self.arch == "deepseek2" and self.arch_meta("expert_gating_func") == _SIGMOID_GATING:
            architecture = "DeepseekV3ForCausalLM"
        return ModelConfig(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.arch_meta("feed_forward_length"),
            num_layers=self.arch_meta("block_count"),
            num_heads=heads,
            num_kv_heads=self.arch_meta("attention.head_count_kv", heads),
            head_dim=self.arch_meta("attention.key_length", hidden // heads),
            max_position_embeddings=self.arch_meta("context_length", 2048),
            rms_norm_eps=self.arch_meta("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(self.arch_meta("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            torch_dtype="float32",
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[e for e in eos if e is not None],
            hidden_act={"gemma3": "gelu_pytorch_tanh", "bert": "gelu"}.get(self.arch, "silu"),
            num_experts=experts,
            num_experts_per_tok=self.arch_meta("expert_used_count", 0),
            moe_intermediate_size=self.arch_meta("expert_feed_forward_length") or self.arch_meta("feed_forward_length"),
            # llama.cpp renormalises the selected experts' weights for both families (qwen3moe's
            # converter drops norm_topk_prob: every released Qwen3-MoE sets it); DeepSeek's say so
            norm_topk_prob=bool(self.arch_meta("expert_weights_norm", False)) if self.arch == "deepseek2" else True,
            pooling=_GGUF_POOLING.get(self.arch_meta("pooling_type", 0)),
            raw={"gguf_arch": self.arch, **raw},
        )

    def _deepseek_settings(self) -> dict:
        """GGUF keys -> the Hugging Face config keys the DeepSeek runtime reads."""
        rope = self.arch_meta("rope.dimension_count")
        groups = self.arch_meta("expert_group_count") or 1
        return {"q_lora_rank": self.arch_meta("attention.q_lora_rank"),
                "kv_lora_rank": self.arch_meta("attention.kv_lora_rank"),
                "qk_rope_head_dim": rope, "qk_nope_head_dim": self.arch_meta("attention.key_length_mla") - rope,
                "v_head_dim": self.arch_meta("attention.value_length_mla"),
                "n_shared_experts": self.arch_meta("expert_shared_count", 0),
                "first_k_dense_replace": self.arch_meta("leading_dense_block_count", 0),
                "routed_scaling_factor": self.arch_meta("expert_weights_scale", 1.0),
                "n_group": groups, "topk_group": self.arch_meta("expert_group_used_count") or 1,
                "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
                "rope_interleave": True}

    def _gemma3_settings(self, head_dim: int) -> dict:
        """GGUF keys -> the Hugging Face config keys the Gemma 3 runtime reads."""
        out = {"sliding_window": self.arch_meta("attention.sliding_window"),
               "rope_local_base_freq": float(self.arch_meta("rope.freq_base_swa", 10000.0)),
               "final_logit_softcapping": self.arch_meta("final_logit_softcapping"),
               "rope_scaling": self._rope_scaling(),
               # Not stored in GGUF; llama.cpp takes the head size (all sizes but 27B).
               "query_pre_attn_scalar": head_dim}
        pattern = self.arch_meta("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: true = sliding window
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif isinstance(pattern, int):
            out["sliding_window_pattern"] = pattern
        return out

    def _rope_scaling(self) -> dict | None:
        if "rope_freqs.weight" in self.tensors:
            # Llama 3.1-style scaling, baked by the converter into per-frequency divisors.
            factors = np.asarray(self.tensors["rope_freqs.weight"].data, dtype=np.float32)
            return {"rope_type": "freq_factors", "factors": factors.tolist()}
        kind = self.arch_meta("rope.scaling.type")
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, "factor": self.arch_meta("rope.scaling.factor", 1.0)}
        if kind == "yarn":  # the keys convert_hf_to_gguf writes, back to transformers' names
            for key, ours in (("original_context_length", "original_max_position_embeddings"),
                              ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                              ("yarn_attn_factor", "attention_factor")):
                if (value := self.arch_meta(f"rope.scaling.{key}")) is not None:
                    scaling[ours] = value
            if self.arch == "gpt-oss":  # its config's (transformers'); llama.cpp always truncates
                scaling["truncate"] = False
            if (log_mul := self.arch_meta("rope.scaling.yarn_log_multiplier")) is not None:
                # DeepSeek's 0.1 * mscale_all_dim; its released configs set mscale equal to it
                scaling["mscale"] = scaling["mscale_all_dim"] = log_mul / 0.1
        return scaling

    def release(self) -> None:
        """After loading: drop the parsed metadata, and let the kernel reclaim file pages that were
        copied into fused weights (pages still in use fault back in from the page cache)."""
        maps = [getattr(part.data, "_mmap", None) for part in self.parts]
        self.reader = self.tensors = self.parts = self.all_tensors = None
        gc.collect()
        for mm in maps:
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED)

    def hf_name(self, name: str) -> str | None:
        if name == "rope_freqs.weight":
            return None
        stem, _, kind = name.rpartition(".")
        if stem in (names := global_names(self.arch)):
            return f"{names[stem]}.{kind}"
        m = _BLOCK.match(name)
        table = layer_names(self.arch)
        if self.arch == "deepseek2" and m is not None and m.group(2) in _KV_B_HALVES:  # (joined by iter_weights)
            return f"model.layers.{m.group(1)}.self_attn.kv_b_proj.{m.group(3)}"
        if m is not None and m.group(2) in EXPERT_NAMES:  # one name per expert: "{}" for its index
            return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{EXPERT_NAMES[m.group(2)]}.{m.group(3)}"
        if m is None or m.group(2) not in table:
            raise UnsupportedFeatureError(f"unexpected GGUF tensor {name!r} for architecture {self.arch!r}")
        return f"{block_prefix(self.arch).format(m.group(1))}.{table[m.group(2)]}.{m.group(3)}"

    def iter_weights(self, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        cfg = self.model_config()
        halves: dict[str, dict[str, np.ndarray]] = {}  # kv_b_proj's name -> its attn_k_b / attn_v_b, dequantized
        for t, part in self.all_tensors:
            name = self.hf_name(t.name)
            if name is None:
                continue
            shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
            data = np.asarray(t.data)
            stem = t.name.rsplit(".", 2)[-2]
            if stem == "attn_kv_b" and self.arch == "deepseek2":  # (an older file's, whole: dense, as the halves)
                yield name, torch.from_numpy(dequantize(data, t.tensor_type).reshape(shape)).to(dtype=dtype,
                                                                                               device=device)
                continue
            if stem in _KV_B_HALVES and self.arch == "deepseek2":
                if t.tensor_type not in _DENSE:  # also as they are, for the CPU's decode rows (QuantizedHeads)
                    half = name.replace(".kv_b_proj.", f".{stem.removeprefix('attn_')}.")  # k_b, v_b
                    yield half, self._tensor(data, t.tensor_type, shape, half, dtype, device)
                got = halves.setdefault(name, {})
                got[stem] = dequantize(data, t.tensor_type).reshape(shape)
                if len(got) == 2:  # k_b [H, rank, nope] (W_UK transposed), v_b [H, v, rank]
                    k_b, v_b = got["attn_k_b"], got["attn_v_b"]
                    joined = np.concatenate((k_b.swapaxes(1, 2), v_b), axis=1).reshape(-1, k_b.shape[1])
                    yield name, torch.from_numpy(np.ascontiguousarray(joined)).to(dtype=dtype, device=device)
                    del halves[name]
                continue
            if self.arch == "llama" and stem in ("attn_q", "attn_k"):
                heads = cfg.num_heads if stem == "attn_q" else cfg.num_kv_heads
                data = unpermute_rows(data.reshape(shape[0], -1), heads)
            if "{}" in name:  # stacked experts (or their biases): expert e's rows are e * R .. (e + 1) * R
                rows = data.reshape(shape[0] * shape[1], -1)
                for e in range(shape[0]):
                    part = rows[e * shape[1]:(e + 1) * shape[1]]
                    yield name.format(e), self._tensor(part, t.tensor_type, shape[1:], name, dtype, device)
            else:
                yield name, self._tensor(data, t.tensor_type, shape, name, dtype, device)
            self._drop_pages(part, int(t.data_offset) + int(t.n_bytes))

    def _drop_pages(self, part: GGUFFile, end: int) -> None:
        """The file's pages up to `end` out of this process's memory once the model took what it
        keeps of the tensors there: weights repacked or converted at load would otherwise hold the
        file's pages beside their copies until loading ends (a peak of twice the file). The whole
        prefix each time: a fused layer (q, k, v) reads its earlier parts again when its last one
        arrives. Pages still in use (weights read in place) fault back in from the page cache."""
        mm = getattr(part.data, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED, 0, end)

    def _tensor(self, data: np.ndarray, qtype, shape: tuple[int, ...], name: str, dtype, device):
        if qtype not in _DENSE:
            return QuantizedTensor(_mapped_bytes(data.reshape(shape[0], -1)), qtype, shape)
        if qtype == GGMLQuantizationType.BF16:  # the reader hands BF16 over as its bytes (numpy has no bfloat16)
            tensor = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16).float()
        else:
            tensor = torch.from_numpy(np.array(data, dtype=np.float32))
        tensor = tensor.reshape(shape)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # the converter stored 1 + w; our Gemma norm adds the 1
        return tensor.to(dtype=dtype, device=device)


def _mapped_bytes(a: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over the array's memory, without copying the memory-mapped file.
    (The map is read-only and nothing writes to quantized weights, hence no warning.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8))


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary pairs -> rotate-half halves).
    Rows are whole quantized blocks, so this is exact on any encoding."""
    n = rows.shape[0]
    return (rows.reshape(num_heads, n // num_heads // 2, 2, -1)
            .swapaxes(1, 2).reshape(n, -1))
