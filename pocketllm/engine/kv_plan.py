"""The memory plan: whether the weights and a request's KV cache fit the device (checked before any
weight is read), how many KV blocks the cache holds (sized before loading on the CPU or from
--num-kv-blocks, from the memory the weights leave on CUDA) and how long a request may be (the
context lowered to what fits when the user did not ask for one, refused with what to change when
they did)."""
from __future__ import annotations

import logging

import torch

from pocketllm.config import EngineArgs, ModelConfig
from pocketllm.core.kv_layout import KVLayout
from pocketllm.errors import ConfigurationError, DoesNotFitError

log = logging.getLogger("pocketllm")


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_memory(device: torch.device, gpu_memory_utilization: float) -> int | None:
    """What the engine may take on `device` before loading: on CUDA the free memory less the share
    gpu_memory_utilization leaves to others, on the CPU the kernel's MemAvailable (None where
    unknown)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - gpu_memory_utilization) * total))
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def step_activation_bytes(cfg: ModelConfig, tokens: int, rows: int, value_bytes: int, attention_context: int) -> int:
    """An upper estimate of what one step's transient tensors take at their peak: `tokens` rows through a
    layer (the hidden state and its residual, Q/K/V, the MLP's gate, up and activation, or the chosen
    experts'), the float32 logits of `rows` sampled rows and the sampler's copies of them, and where the
    attention runs in torch (`attention_context` > 0) one layer's float32 scores over that context."""
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    width = cfg.moe_intermediate_size * cfg.num_experts_per_tok if cfg.num_experts else cfg.intermediate_size
    per_token = 2 * cfg.hidden_size + (heads + 2 * kv) * d + heads * d + 3 * width
    logits = 3 * rows * cfg.vocab_size * 4
    scores = heads * tokens * attention_context * 4
    return tokens * per_token * value_bytes + logits + scores


class KVPlan:
    def __init__(self, args: EngineArgs, layout: KVLayout, block_size: int, device: torch.device, model_positions: int):
        self.args, self.layout, self.block_size, self.device = args, layout, block_size, device
        # every layer's K and V of a block id, a draft model's too: set before the cache is sized
        self.bytes_per_block: int | None = None  # (0: an encoder, which keeps no KV)
        # one step's transient tensors, and on CUDA the decode graphs' memory pool: set with bytes_per_block
        self.activation_bytes = self.graph_bytes = 0
        asked = args.max_model_len
        if asked is not None and asked > model_positions:
            raise ConfigurationError(f"max_model_len {asked} exceeds the model's maximum of {model_positions} "
                                     "positions; lower max_model_len")
        self.max_model_len = model_positions if asked is None else asked

    def plan_steps(self, cfg: ModelConfig, value_bytes: int, graphs: bool) -> None:
        """What a step's tensors take (on the CPU the torch attention's scores too), and on CUDA with `graphs`
        the decode graphs' one pool, sized by the largest: a step of max_num_seqs rows."""
        args = self.args
        steps, cpu = args.max_num_batched_tokens, self.device.type == "cpu"
        context = self.max_model_len if cpu else 0  # (CUDA: the kernels, no scores)
        self.activation_bytes = step_activation_bytes(cfg, steps, args.max_num_seqs, value_bytes, context)
        if graphs and self.device.type == "cuda":
            self.graph_bytes = step_activation_bytes(cfg, args.max_num_seqs, 0, value_bytes, 0)

    def check_fits(self, weight_bytes: int, what: str, *, mapped: bool, experts: bool = False,
                   quantized_kv: bool = True) -> None:
        """Before any weight is read: one log line of what loading will take against what the device
        has, and where the weights and one request's KV cache cannot fit, one line with the numbers
        and what would make it fit: refused (it would end in an out-of-memory error), but a warning
        for a `mapped` file on the CPU (weights read in place page in and out of the file, slowly). `quantized_kv`:
        the runtime reads an 8-bit cache (suggested only then)."""
        args = self.args
        assert self.bytes_per_block is not None, "bytes_per_block first"
        # a request of the asked context; of a prompt step's length where the context is the model's
        # (lowered to what the cache holds once it is sized)
        tokens = self.max_model_len if args.max_model_len is not None else min(self.max_model_len,
                                                                                 args.max_num_batched_tokens)
        kv = self.blocks_per_request(tokens) * self.bytes_per_block
        transient = self.activation_bytes + self.graph_bytes
        need = weight_bytes + kv + transient
        available = available_memory(self.device, args.gpu_memory_utilization)
        if available is None:
            return
        graphs = f" + CUDA graphs {size_text(self.graph_bytes)}" if self.graph_bytes else ""
        log.info("memory plan: weights %s + KV cache of one %d-token request %s + activations %s%s, of %s "
                 "available on %s", size_text(weight_bytes), tokens, size_text(kv), size_text(self.activation_bytes),
                 graphs, size_text(available), self.device)
        if need <= available:
            return
        per_token = kv / max(tokens, 1)
        fixes = [f"--max-model-len (the KV cache takes {size_text(int(per_token * 1024))} per 1,024 tokens)"
                 if args.max_model_len is not None else None,
                 "--kv-cache-dtype int8 (8-bit keys and values)" if args.kv_cache_dtype == "auto" and quantized_kv
                 else None,
                 "a file of fewer bits per weight"]
        if self.device.type == "cuda":
            fixes += ["--cpu-offload-experts (experts in host memory)" if experts and args.cpu_offload_experts != "all"
                      else None, f"--gpu-memory-utilization (now {args.gpu_memory_utilization})",
                      "--tensor-parallel-size"]
        elif not mapped and args.dtype in ("auto", "float32"):  # the CPU holds dense weights in float32 by default
            fixes.append("--dtype bfloat16 (half the bytes of float32)")
        if transient > max(weight_bytes, kv) // 4:  # where a step's tensors weigh, their bounds
            fixes += [f"--max-num-batched-tokens (now {args.max_num_batched_tokens})",
                      f"--max-num-seqs (now {args.max_num_seqs})"]
        message = (f"{what} does not fit on {self.device}: its weights take {size_text(weight_bytes)}, the KV "
                   f"cache of one {tokens}-token request {size_text(kv)} and a step's activations"
                   f"{' and CUDA graphs' if self.graph_bytes else ''} {size_text(transient)}, {size_text(need)} in "
                   f"all, but {size_text(available)} is available; what would make it fit: "
                   + ", ".join(f for f in fixes if f))
        if mapped and self.device.type == "cpu":
            log.warning("%s", message)
        else:
            raise DoesNotFitError(message)

    def blocks_before_loading(self) -> int | None:
        """The cache's blocks where they are known before loading (the CPU's memory budget, or
        --num-kv-blocks), with the context fitted to them; None on CUDA, sized after loading."""
        args = self.args
        assert self.bytes_per_block is not None, "bytes_per_block first"
        if self.device.type != "cpu" and args.num_kv_blocks is None:
            return None
        num_blocks = args.num_kv_blocks or args.kv_cache_memory // self.bytes_per_block
        self.fit(num_blocks)
        return num_blocks

    def blocks_after_loading(self) -> int:
        """CUDA: the blocks that the loaded weights leave room for under gpu_memory_utilization."""
        args = self.args
        torch.cuda.empty_cache()  # what loading left in the allocator's cache is free for the KV cache
        free, _ = torch.cuda.mem_get_info(self.device)
        log.info("GPU memory after loading: %s free, %s held by this process's tensors", size_text(free),
                 size_text(torch.cuda.memory_allocated(self.device)))
        total = torch.cuda.get_device_properties(self.device).total_memory
        # (a step's activations and the graphs' pool come out of the same budget, after the cache)
        budget = free - (1 - args.gpu_memory_utilization) * total - self.activation_bytes - self.graph_bytes
        # Beyond a few full-length sequences per slot, blocks only feed the prefix cache.
        cap = 4 * args.max_num_seqs * self.blocks_per_request(self.max_model_len)
        num_blocks = max(0, min(int(budget // self.bytes_per_block), cap))
        self.fit(num_blocks)
        return num_blocks

    def fit(self, num_blocks: int) -> None:
        """A max_model_len that was asked for must fit one request in the KV cache. The default one,
        the model's context, is lowered to what fits (as llama.cpp and Ollama do), and one log line
        says why."""
        limits = self.context_limits(num_blocks) if num_blocks > 0 else []
        if self.args.max_model_len is None and limits:
            length, why = min(limits)
            if length < self.max_model_len:
                log.info("max_model_len %d (the model's context is %d; %s)", length, self.max_model_len, why)
                self.max_model_len = length
        need = self.blocks_per_request(self.max_model_len)
        if num_blocks < need:
            raise ConfigurationError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, but one request of "
                f"max_model_len={self.max_model_len} tokens needs {need}; raise num_kv_blocks / "
                "kv_cache_memory / gpu_memory_utilization or lower max_model_len")

    def context_limits(self, num_blocks: int) -> list[tuple[int, str]]:
        """(longest request, why) for each limit on the context besides the model's own."""
        args = self.args
        tokens = self.layout.max_tokens(num_blocks, self.block_size, args.max_num_batched_tokens)
        if args.num_kv_blocks is not None:
            cache, more = f"{num_blocks} blocks", "--num-kv-blocks"
        elif self.device.type == "cuda":
            cache = f"{size_text(num_blocks * self.bytes_per_block)} (gpu_memory_utilization {args.gpu_memory_utilization})"
            more = "--gpu-memory-utilization or --num-kv-blocks"
        else:
            cache, more = size_text(num_blocks * self.bytes_per_block), "--kv-cache-memory or --num-kv-blocks"
        limits = [] if tokens is None else [
            (tokens, f"the KV cache of {cache} holds {tokens} tokens; raise {more} for more")]
        if not args.enable_chunked_prefill:  # then a whole prompt must fit in one step
            n = args.max_num_batched_tokens
            limits.append((n, f"without chunked prefill a prompt must fit in one step of "
                              f"max_num_batched_tokens={n}; raise --max-num-batched-tokens for more"))
        return limits

    def blocks_per_request(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, every KV group counted
        (a sliding group holds its window and the step's chunk)."""
        return self.layout.blocks_for(num_tokens, self.block_size, self.args.max_num_batched_tokens)
