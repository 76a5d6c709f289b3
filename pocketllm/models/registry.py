"""Architecture name -> runtime module. Adding a model costs a module and one line here.

Modules are imported lazily, so an unsupported model costs nothing and fails at selection.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from pocketllm.config import EngineArgs, ModelConfig
from pocketllm.core.kv_layout import KVLayout
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.kernels import platform as kernel_platform
from pocketllm.models.capabilities import PLATFORMS, SLIDING_WINDOW_KV, RuntimeCapabilities, check, check_tensor_parallel

_RUNTIMES = {
    "LlamaForCausalLM": ("pocketllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pocketllm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pocketllm.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("pocketllm.models.gemma3", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pocketllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("pocketllm.models.mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("pocketllm.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("pocketllm.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pocketllm.models.deepseek", "DeepseekV3ForCausalLM"),
    "BertModel": ("pocketllm.models.bert", "BertModel"),
    "RobertaModel": ("pocketllm.models.bert", "RobertaModel"),
    "XLMRobertaModel": ("pocketllm.models.bert", "RobertaModel"),
    "NomicBertModel": ("pocketllm.models.bert", "NomicBertModel"),
}


def supported_architectures() -> list[str]:
    return sorted(_RUNTIMES)


@dataclass
class RuntimeSelection:
    model_class: type
    capabilities: RuntimeCapabilities
    kv_layout: KVLayout  # which layers share a block table


def select_runtime(cfg: ModelConfig, args: EngineArgs, device: str, dtype: str,
                   quant_types: set[str] = frozenset()) -> RuntimeSelection:
    """Pick the runtime for `cfg` and check the configuration against what it declares."""
    if cfg.architecture not in _RUNTIMES:
        raise UnsupportedFeatureError(
            f"architecture {cfg.architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}")
    module_name, class_name = _RUNTIMES[cfg.architecture]
    cls = getattr(importlib.import_module(module_name), class_name)
    caps: RuntimeCapabilities = cls.capabilities
    where = f"the {cfg.architecture} runtime"
    platform = PLATFORMS[device]
    check("device", device, caps.devices, where)
    check("dtype", dtype, caps.dtypes, where)
    check("dtype", dtype, platform.dtypes, f"the {device} platform")
    rope = (cfg.rope_scaling or {}).get("rope_type", "default")
    check("rope scaling", rope, caps.rope_scaling, where)
    for qtype in sorted(quant_types):
        check("quantization type", qtype, caps.quantizations, where)
        check("quantization type", qtype, platform.quantizations, f"the {device} platform")
    if args.cpu_offload_experts is not None:
        # (the platform whose kernels run the model: the GPU's, which tests run on CPU tensors too)
        kernels = PLATFORMS["cuda" if device in kernel_platform.TRITON_DEVICES else device]
        if not caps.expert_offload:
            raise UnsupportedFeatureError(f"{where} has no mixture-of-experts layers: cpu_offload_experts is for "
                                          "models with experts (Qwen3-MoE, Mixtral, gpt-oss)")
        if not kernels.expert_offload:
            raise UnsupportedFeatureError(f"the {device} platform holds every weight in host memory already: "
                                          "cpu_offload_experts is for CUDA devices")
        if args.tensor_parallel_size > 1:
            raise UnsupportedFeatureError("cpu_offload_experts runs with tensor_parallel_size 1")
    check("KV cache dtype", args.kv_cache_dtype, caps.kv_cache_dtypes, where)
    check("KV cache dtype", args.kv_cache_dtype, platform.kv_cache_dtypes, f"the {device} platform")
    for kind in cls.attention_kinds(cfg):
        check("attention kind", kind, caps.attention_kinds, where)
    windows = cls.layer_windows(cfg)
    if any(w is not None for w in windows):
        check("sliding-window KV layout", caps.sliding_window_kv, SLIDING_WINDOW_KV, where)
        if caps.sliding_window_kv == "full":  # one table: the window layers keep the whole sequence
            windows = [None] * len(windows)
    if caps.encoder and args.task == "generate":
        raise UnsupportedFeatureError(f"{where} is an encoder: it serves embeddings (task embed), not generation")
    if args.enable_prefix_caching and not caps.prefix_caching and not caps.encoder:  # (an encoder keeps no KV)
        raise UnsupportedFeatureError(f"{where} does not support prefix caching; "
                                      "pass enable_prefix_caching=False")
    check_tensor_parallel(cfg, args.tensor_parallel_size, quant_types, caps, where)
    if args.enable_lora and not caps.lora:
        raise UnsupportedFeatureError(f"{where} does not run LoRA adapters")
    if args.speculative is not None and args.speculative.method == "mtp":
        if not caps.next_token_drafts:
            raise UnsupportedFeatureError(f"{where} has no next-token-prediction layer: speculative method mtp is "
                                          "for DeepSeek-V3 checkpoints (DeepseekV3ForCausalLM)")
        if not cfg.raw.get("num_nextn_predict_layers"):
            raise UnsupportedFeatureError("this checkpoint has no next-token-prediction layer "
                                          "(num_nextn_predict_layers is 0): speculative method mtp needs one; "
                                          "methods ngram and draft_model need none")
    if caps.max_batch_size is not None and args.max_num_seqs > caps.max_batch_size:
        raise UnsupportedFeatureError(
            f"{where} supports at most {caps.max_batch_size} sequences per batch; "
            f"lower max_num_seqs (got {args.max_num_seqs})")
    return RuntimeSelection(cls, caps, KVLayout.of(windows))
