"""One model on one device, and its runner: what the engine (rank 0), every tensor-parallel rank
and a draft model each build, in the same three steps."""
from __future__ import annotations

import torch

from pocketllm.config import EngineArgs
from pocketllm.core.kv_layout import KVLayout
from pocketllm.loaders.model_source import ModelSource
from pocketllm.models.registry import select_runtime
from pocketllm.runner.model_runner import ModelRunner

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    """1. Constructed: the file's header read and the configuration checked against the runtime's
    declared capabilities (`select_runtime`), no weight read. 2. `load`: the weights, on `device`.
    3. `build_runner`: the KV cache and the runner, once the engine has sized the cache."""

    def __init__(self, source: ModelSource, args: EngineArgs, device: torch.device, dtype_name: str):
        self.source, self.args, self.device = source, args, device
        self.config = source.config
        self.dtype = TORCH_DTYPES[dtype_name]
        self.runtime = select_runtime(self.config, args, device.type, dtype_name, source.quant_types)
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None

    @classmethod
    def open(cls, model: str, args: EngineArgs, device: torch.device, dtype_name: str) -> Worker:
        return cls(ModelSource.open(model, args.load_format), args, device, dtype_name)

    def planned_weight_bytes(self) -> int:
        """What `load` will hold, from the file's header or the model's shapes, before any weight is read."""
        return self.source.weight_bytes(self.runtime.model_class, self.dtype, self.device,
                                        dequantize_at_load=self.args.dequantize_at_load,
                                        cpu_offload_experts=self.args.cpu_offload_experts,
                                        expert_cache=self.args.expert_cache)

    def load(self, max_model_len: int, seed: int | None = None) -> torch.nn.Module:
        args = self.args
        self.model = self.source.load(self.runtime.model_class, self.dtype, self.device, max_model_len,
                                      seed=args.seed if seed is None else seed,
                                      dequantize_at_load=args.dequantize_at_load, exact_kernels=args.exact_kernels,
                                      cpu_offload_experts=args.cpu_offload_experts, expert_cache=args.expert_cache)
        return self.model

    def lora_manager(self, max_rows: int, named: bool = True):
        """The loaded model's LoRA adapter slots (runner.lora_manager), None without enable_lora; `named`: the
        adapters `lora_modules` names registered (a tensor-parallel rank fills its slots as rank 0 says).
        `max_rows`: the most rows of a step."""
        if not self.args.enable_lora:
            return None
        from pocketllm.runner.lora_manager import LoRAManager

        args = self.args
        lora = LoRAManager(self.model, args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras,
                           max_rows=max_rows)
        for name, path in args.lora_paths.items() if named else ():
            lora.load(name, path)
        return lora

    def build_runner(self, num_blocks: int, block_size: int, max_model_len: int, *, max_decode_rows: int = 64,
                     enforce_eager: bool | None = None, kv_layout: KVLayout | None = None,
                     lora=None) -> ModelRunner:
        assert self.model is not None, "load() first"
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.dtype, self.device, self.args.seed,
                                  max_decode_rows=max_decode_rows, max_model_len=max_model_len,
                                  # (a layer whose experts run on the host waits for it: no CUDA graphs)
                                  enforce_eager=(self.args.enforce_eager if enforce_eager is None else enforce_eager)
                                  or self.args.cpu_offload_experts is not None,
                                  kv_layout=kv_layout or self.runtime.kv_layout, reserve_kv=self.args.reserve_kv_cache,
                                  kv_cache_dtype=self.args.kv_cache_dtype, lora=lora)
        return self.runner
