"""What a model runtime (and a platform) declares it supports, checked before any weight loads."""
from __future__ import annotations

from dataclasses import dataclass

from pocketllm.config import KV_CACHE_DTYPES
from pocketllm.errors import UnsupportedFeatureError

# GGUF types every runtime can hold: the quant package implements all of them for every layer.
GGUF_TYPES = frozenset({
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    "MXFP4",
})


# Hugging Face checkpoint quantizations every runtime loads: block-scaled FP8 (pocketllm.quant.fp8), kept
# in FP8 on the GPU (one rank: its projections, multiplied by kernels/triton/fp8.py), dequantized at load
# on the CPU, with tensor parallelism, and for the layers read as numbers (experts, the router, MLA's kv_b).
CHECKPOINT_QUANTS = frozenset({"FP8"})


@dataclass(frozen=True)
class RuntimeCapabilities:
    attention_kinds: frozenset[str] = frozenset({"full"})  # full | sliding_window
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    quantizations: frozenset[str] = GGUF_TYPES | CHECKPOINT_QUANTS
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    rope_scaling: frozenset[str] = frozenset({"default", "linear", "llama3", "freq_factors", "yarn"})
    prefix_caching: bool = True
    cuda_graphs: bool = False
    cuda_graph_max_batch: int | None = None  # decode batches above this run eagerly (None: max_num_seqs)
    max_batch_size: int | None = None
    # How sliding-window layers hold KV: "window" = in KV groups of their own whose blocks behind
    # the window go back to the pool (the layers read their group's table: the Attention of
    # pocketllm.models.llama); "full" = in the full-attention layers' table, the whole sequence.
    sliding_window_kv: str = "full"
    # Tensor parallelism: every layer sharded as pocketllm.layers.linear describes (attention heads,
    # MLP and expert intermediate features, vocabulary), under the rule of `check_tensor_parallel`.
    tensor_parallel: bool = True
    # What the KV cache may hold (pocketllm.core.kv_dtype): every runtime whose layers attend
    # through pocketllm.layers.attention (the Attention of pocketllm.models.llama) reads 8-bit caches.
    kv_cache_dtypes: frozenset[str] = frozenset(KV_CACHE_DTYPES)
    # Mixture-of-experts layers (pocketllm.layers.moe.SparseMoE) whose experts may live in host memory
    # (cpu_offload_experts).
    expert_offload: bool = False
    # An encoder (BERT): bidirectional attention over each whole prompt, computed in one step and pooled
    # (task embed only); it keeps no KV cache, so prefix caching and chunked prefill do not apply.
    encoder: bool = False
    # Speculative method "mtp": the checkpoint's next-token-prediction layers draft (DeepSeek-V3's;
    # the runtime's `draft_module` builds the first of them over the loaded model).
    next_token_drafts: bool = False
    # LoRA adapters on the decoder layers' attention and dense MLP projections (pocketllm.layers.lora)
    lora: bool = True


SLIDING_WINDOW_KV = frozenset({"full", "window"})  # the KV layouts the engine builds


# GGUF types the CUDA platform multiplies in their GGUF encoding (the Triton kernels of
# pocketllm/kernels/triton/gguf.py, TRITON_GGUF_TYPES; a test keeps the two lists equal).
CUDA_KERNEL_TYPES = frozenset({
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4",
})


@dataclass(frozen=True)
class PlatformCapabilities:
    name: str
    dtypes: frozenset[str]
    quantizations: frozenset[str]  # GGUF types that load
    # The quantized types kept in their GGUF encoding in memory and multiplied as such; the
    # platform dequantizes the other quantized types at load, to the model's dtype (exact, but
    # 2 bytes a weight in bfloat16: the slower path).
    kept_quantized: frozenset[str]
    kv_cache_dtypes: frozenset[str]  # the KV caches its attention kernels read
    expert_offload: bool  # experts may be held in host memory, off the device (cpu_offload_experts)


PLATFORMS = {
    "cpu": PlatformCapabilities("cpu", frozenset({"float32", "bfloat16"}), GGUF_TYPES | CHECKPOINT_QUANTS,
                                GGUF_TYPES - {"F32", "F16", "BF16"}, frozenset({"auto", "int8"}),
                                False),
    # Every GGUF type loads on CUDA, and every quantized one stays in its GGUF encoding there.
    "cuda": PlatformCapabilities("cuda", frozenset({"float32", "bfloat16", "float16"}), GGUF_TYPES | CHECKPOINT_QUANTS,
                                 CUDA_KERNEL_TYPES, frozenset(KV_CACHE_DTYPES), True),
}


def check(what: str, asked: str, supported: frozenset[str] | set[str], where: str) -> None:
    if asked not in supported:
        raise UnsupportedFeatureError(
            f"{where} does not support {what} {asked!r}; supported: {', '.join(sorted(supported))}")


def check_tensor_parallel(cfg, tp: int, quant_types: set[str], caps: RuntimeCapabilities, where: str) -> None:
    """The sharding rule, before any weight is read: attention heads, KV heads (or ranks per KV
    head), intermediate features (dense and expert) and the vocabulary split evenly over the
    ranks, and a row-parallel layer's input share (o_proj's heads, down_proj's features) holds
    whole GGUF blocks of every quantized type in the file."""
    if tp == 1:
        return
    if not caps.tensor_parallel:
        raise UnsupportedFeatureError(f"{where} does not support tensor parallelism; use tensor_parallel_size 1")
    sizes = {"attention heads": cfg.num_heads, "vocabulary size": cfg.vocab_size,
             "intermediate size": cfg.intermediate_size}
    if cfg.num_experts:
        sizes["expert intermediate size"] = cfg.moe_intermediate_size
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        bad.append(f"KV heads {cfg.num_kv_heads} (nor does it divide {tp})")
    if bad:
        raise UnsupportedFeatureError(f"tensor_parallel_size {tp} does not divide the model's {', '.join(bad)}; "
                                      "pick a size that divides each")
    from gguf import GGMLQuantizationType

    from pocketllm.core.gguf_types import block_size

    blocks = {q: block_size(GGMLQuantizationType[q]) for q in quant_types if q in GGMLQuantizationType.__members__}
    inputs = {"o_proj": cfg.num_heads * cfg.head_dim // tp,
              "down_proj": (cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size) // tp}
    if cfg.num_experts and cfg.intermediate_size:
        inputs["dense down_proj"] = cfg.intermediate_size // tp
    for q, bs in sorted(blocks.items()):
        for name, k in inputs.items():
            if k % bs:
                raise UnsupportedFeatureError(
                    f"tensor_parallel_size {tp} gives each rank {k} of {name}'s input features, which splits "
                    f"{q}'s blocks of {bs}; pick a size that leaves each rank whole blocks")
