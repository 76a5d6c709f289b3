"""A model's source: a Hugging Face directory, a GGUF file or (random weights) a named shape. Its
shape, quantization and tokenizer are read before any weight; `load` then builds the runtime's
model and reads the weights into it. The engine opens one for its model, and one for a draft model."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pocketllm.config import ModelConfig
from pocketllm.distributed.parallel_state import get_tp
from pocketllm.kernels.platform import KernelConfig, building_with


@dataclass
class ModelSource:
    path: Path
    dummy: bool  # random weights (load_format dummy); `path` may then name a shape
    config: ModelConfig
    quant_types: set[str] = field(default_factory=set)
    gguf: object = None  # the open GGUFModelFile, for a .gguf file
    fp8: object = None  # a block-scaled FP8 checkpoint's Fp8Blocks (dequantized at load)

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None

    @classmethod
    def open(cls, model: str, load_format: str) -> ModelSource:
        from pocketllm.core.shapes import SHAPES

        path = Path(model)
        dummy = load_format == "dummy"
        if path.is_file() and path.suffix == ".gguf":
            from pocketllm.loaders import gguf_loader

            gguf = gguf_loader.GGUFModelFile(path)
            return cls(path, dummy, gguf.model_config(), gguf.quant_types(), gguf)
        config = (ModelConfig.from_hf_dict(SHAPES[model]) if model in SHAPES
                  else ModelConfig.from_hf_dir(path if path.is_dir() else path.parent))
        # a checkpoint quantized by a Hugging Face method (MXFP4, AWQ, GPTQ, ...) is checked as GGUF
        # types are: against what the runtime declares, before any weight is read
        method = (config.raw.get("quantization_config") or {}).get("quant_method")
        fp8 = None
        if method == "fp8":  # (a form it does not read: refused now)
            from pocketllm.quant.fp8 import Fp8Blocks

            fp8 = Fp8Blocks.of(config.raw)
        return cls(path, dummy, config, {str(method).upper()} if method else set(), fp8=fp8)

    def tokenizer(self, tokenizer_path: str | None = None):
        """The tokenizer of `tokenizer_path`, else the model's own; None for weights alone (or a
        named shape): token ids in, token ids out."""
        tok_path = Path(tokenizer_path) if tokenizer_path else self.path
        if self.is_gguf and tok_path == self.path:  # the reader is open already: parse the file once
            from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf
            return tokenizer_from_gguf(self.gguf.reader)
        if not self.is_gguf and tok_path == self.path and not (self.path / "tokenizer.json").exists():
            return None
        from pocketllm.tokenizer import get_tokenizer
        return get_tokenizer(tok_path)

    def weight_bytes(self, model_class, dtype: torch.dtype, device: torch.device, *, dequantize_at_load: bool,
                     cpu_offload_experts: str | None = None, expert_cache: int | None = None) -> int:
        """What the weights will take on `device` (experts offloaded to host memory left out, but for the
        slots they are copied to), from the file's header or the model's shapes (built on the meta device: no
        memory), before any weight is read."""
        from pocketllm.layers.linear import Linear
        from pocketllm.layers.moe import offload_experts
        from pocketllm.models.capabilities import PLATFORMS

        model, moved = None, []
        if cpu_offload_experts is not None or not self.is_gguf:
            # (an FP8 checkpoint's layers built as loading builds them: `keeps_fp8` says which keep FP8 weights)
            kernels = KernelConfig() if self.fp8 is None else replace(KernelConfig.plain(device),
                                                                      dequantize_at_load=dequantize_at_load)
            with building_with(kernels):
                model = model_class(self.config, dtype=dtype, device="meta", max_model_len=1)
            if cpu_offload_experts is not None:
                moved = offload_experts(model, cpu_offload_experts, KernelConfig(), expert_cache)
        # the share of an offloaded layer's experts on the device: its slots (copy), or none (compute)
        on_device = moved[0].cache_slots / len(moved[0].experts) if moved else 1.0  # (every layer's alike)
        if not self.is_gguf:
            size = torch.finfo(dtype).bits // 8
            offloaded = {id(p) for moe in moved for p in moe.experts.parameters()}
            held = sum(p.numel() * (on_device if id(p) in offloaded else 1.0) for p in model.parameters()) * size
            if self.fp8 is not None:  # the FP8 weights kept: a byte a weight and a scale a tile
                from pocketllm.loaders.safetensors_loader import tensor_names

                tile = self.fp8.rows * self.fp8.cols
                from pocketllm.loaders.dummy_loader import fp8_layers

                fp8 = (fp8_layers(model) if self.dummy
                       else {model.destination(name)[0] for name in tensor_names(self.path, "F8_E4M3")})
                held -= sum(m.weight.numel() * (size - 1 - 4 / tile) for path, m in model.named_modules()
                            if isinstance(m, Linear) and m.keeps_fp8 and path in fp8)
            return round(held)
        dense = torch.finfo(torch.float32 if device.type == "cpu" else dtype).bits // 8
        kept = frozenset() if dequantize_at_load else PLATFORMS[device.type].kept_quantized
        experts = self.gguf.held_bytes(kept, dense, self.gguf.expert_layers(cpu_offload_experts), experts_only=True)
        return self.gguf.held_bytes(kept, dense) - round((1 - on_device) * experts)

    def load(self, model_class, dtype: torch.dtype, device: torch.device, max_model_len: int, *, seed: int,
             dequantize_at_load: bool, exact_kernels: bool, cpu_offload_experts: str | None = None,
             expert_cache: int | None = None):
        """The runtime's model with its weights read (random ones for a dummy source); with
        `cpu_offload_experts`, the experts of those layers in host memory on the CPU's kernels, or
        (`expert_cache`: slots a layer, 0 the default) copied to the device as steps select them."""
        kernels = KernelConfig.choose(device, dtype, exact_kernels=exact_kernels, tp_size=get_tp().size)
        host = KernelConfig.host(exact_kernels=exact_kernels)
        if self.is_gguf:
            from pocketllm.kernels.dispatch import int8_passes

            passes = 0 if exact_kernels else int8_passes(self.config.hidden_size)
            kernels = replace(kernels, int8_passes=passes)
            host = replace(host, int8_passes=passes if host.cpu_fused else 0, dequantize_at_load=dequantize_at_load)
        kernels = replace(kernels, dequantize_at_load=dequantize_at_load)  # (GGUF blocks and FP8 weights alike)
        # (modules built while the weights load, a tied output layer say, run the same kernels)
        with building_with(kernels):
            model = model_class(self.config, dtype=dtype, device=device, max_model_len=max_model_len)
            if cpu_offload_experts is not None:
                from pocketllm.layers.moe import offload_experts

                offload_experts(model, cpu_offload_experts, host, expert_cache, dtype)
            if self.dummy:
                from pocketllm.loaders.dummy_loader import dummy_weights
                model.load_weights(dummy_weights(model, dtype, device, seed, fp8=self.fp8))
            elif self.is_gguf:
                model.load_weights(self.gguf.iter_weights(dtype, device))
            else:
                from pocketllm.loaders.safetensors_loader import iter_safetensors
                model.load_weights((n, t.to(device)) for n, t in iter_safetensors(self.path, dtype, self.fp8,
                                                                                  model.reads_tensor))
        model.eval()
        if self.is_gguf:
            self.gguf.release()
        return model
