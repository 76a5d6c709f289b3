"""Every EngineArgs field as a command-line flag (`max_num_seqs` -> `--max-num-seqs`)."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from pocketllm.config import EngineArgs

_HELP = {
    "model": "Hugging Face model directory, .gguf file, or a name on the hub: org/name[@revision][:QUANT] "
             "(fetched into huggingface_hub's cache; default: the built-in default model)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: float32 on CPU; on CUDA the model's float16, "
             "else bfloat16)",
    "device": "auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible)",
    "max_model_len": "longest request, prompt and output, in tokens (default: the model's context, "
                     "lowered to what the KV cache holds)",
    "block_size": "tokens per KV cache block, a multiple of 8 (default: 16)",
    "num_kv_blocks": "number of KV blocks (overrides --kv-cache-memory and --gpu-memory-utilization)",
    "kv_cache_memory": "bytes of KV cache on CPU (default: 1073741824, 1 GiB)",
    "kv_cache_dtype": "auto | int8 | fp8: what the KV cache holds (auto: the model's dtype; int8 and fp8 "
                      "(e4m3): 8-bit values and a scale per token and head, about half the memory of bfloat16 "
                      "and a quarter of float32; the CPU takes int8, CUDA both)",
    "cpu_offload_experts": "CUDA, mixture-of-experts models: N | all: the experts of the first N layers (all: every "
                           "layer) stay in host memory and run on the CPU's kernels, the rest on the GPU (llama.cpp's "
                           "--n-cpu-moe), for a model whose experts do not fit the card (default: none)",
    "expert_offload": "compute | copy: how the experts --cpu-offload-experts holds in host memory run: compute: on "
                      "the CPU's kernels; copy: copied to the GPU as steps select them, into --expert-cache-slots "
                      "slots a layer that keep the experts the router selects most (default: compute)",
    "expert_cache_slots": "--expert-offload copy: experts a layer keeps on the GPU (default: 4 x the experts a "
                          "token takes)",
    "task": "auto | generate | embed: what requests do; embed pools each prompt into a vector (/v1/embeddings) "
            "(default: auto: embed for an embedding model, as its sentence-transformers files or GGUF's "
            "pooling_type say, generate otherwise)",
    "reserve_kv_cache": "CPU: hold the KV cache's memory from the start, not as blocks are first used "
                        "(default: on for serve, off for chat and generate)",
    "gpu_memory_utilization": "CUDA: fraction of the GPU's memory for weights and KV cache together "
                              "(default: 0.9)",
    "max_num_seqs": "most sequences in one step (default: 64)",
    "max_num_batched_tokens": "most tokens in one step (default: 2048 on a GPU, 256 on the CPU)",
    "max_prefill_tokens_with_decodes": "most prompt tokens in a step that also decodes, so that a long prompt "
                                       "delays the decoding streams by a bounded step (default: the step's "
                                       "limit on a GPU, 64 on the CPU)",
    "enable_prefix_caching": "reuse the KV cache of a prompt prefix seen before (default: on)",
    "enable_chunked_prefill": "split a long prompt over several steps (default: on; off: a prompt must fit "
                              "in --max-num-batched-tokens)",
    "seed": "random seed of sampling and of dummy weights (default: 0)",
    "enforce_eager": "CUDA: run every step eagerly, without CUDA graphs (default: off)",
    "async_scheduling": "launch each step while the GPU runs the one before (default: on for CUDA, off on CPU)",
    "dequantize_at_load": "GGUF and FP8 checkpoints: dequantize the weights when loading, trading memory for speed "
                          "(default: off; the GPU keeps FP8 projections in FP8, the CPU dequantizes them)",
    "exact_kernels": "CPU: exactly dequantized GGUF weights in float32 and torch's ops between the matmuls, "
                     "token-identical to transformers (default: off: integer dot products over 8-bit "
                     "activations and fused C kernels, faster, within the activations' rounding)",
    "load_format": "auto | dummy (random weights; MODEL may then name a shape such as llama3-8b)",
    "tokenizer": "a model directory with tokenizer.json, or a GGUF file (default: the model's own)",
    "num_threads": "CPU threads for torch (default: torch's choice)",
    "speculative_config": "speculative decoding, as JSON (vLLM's speculative_config): "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
                          "proposes the tokens that followed the last n tokens' earlier occurrence (default: off)",
    "enable_lora": "LoRA adapters: slots on the attention and MLP projections for --max-loras adapters at once; "
                   "a request names its adapter as its model (default: off)",
    "lora_modules": "LoRA adapters loaded at start: name=path ... (PEFT directories; needs --enable-lora)",
    "max_loras": "LoRA adapters run in one step (default: 1)",
    "max_lora_rank": "the largest LoRA rank an adapter may have (default: 16)",
    "max_cpu_loras": "LoRA adapters kept read in host memory, least recently used first out (default: --max-loras)",
    "tensor_parallel_size": "ranks holding a shard of every layer each: on CUDA one GPU a rank (NCCL), on the CPU "
                            "processes sharing the cores (gloo) (default: 1)",
}


def _help(f: dataclasses.Field) -> str:
    return _HELP.get(f.name, f"(default: {f.default})")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=_HELP["model"])
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if typing.get_origin(base[0]) is list:
            group.add_argument(flag, nargs="+", default=f.default, metavar="NAME=PATH", help=_help(f))
        elif base[0] is bool:
            group.add_argument(flag, type=_bool, nargs="?", const=True, default=f.default,
                               metavar="BOOL", help=_help(f))
            if f.default is not False:
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                   help=f"same as {flag} false")
        else:
            group.add_argument(flag, type=base[0], default=f.default, help=_help(f))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
