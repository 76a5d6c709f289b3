"""What every model runtime shares: the contract the engine relies on and the generic
weight-name walk (checkpoint tensor -> module.load)."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from pocketllm.config import ModelConfig
from pocketllm.core.kv_layout import KVShape
from pocketllm.errors import ConfigurationError
from pocketllm.layers.attention import AttentionMetadata
from pocketllm.layers.linear import Embedding, Linear, QuantizedTensor
from pocketllm.layers.norm import RMSNorm
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.quant.fp8 import Fp8Weight

_SUFFIX = re.compile(r"\.(weight|bias)$")


def sliding_windows(cfg: ModelConfig, layer_types: list[str]) -> list[int | None]:
    """Each layer's window from transformers' `layer_types`: `sliding_window` for
    "sliding_attention" layers, None (full attention) for the others."""
    return [cfg.raw.get("sliding_window") if t == "sliding_attention" else None for t in layer_types]


class CausalLM(torch.nn.Module):
    """Contract: `forward(input_ids [T], positions [T], meta) -> hidden [T, H]`,
    `compute_logits(hidden [N, H]) -> float32 [N, V]`, `load_weights`, and the KV geometry."""

    capabilities = RuntimeCapabilities()
    # checkpoint module name -> (our fused module, shard index)
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that hold nothing we need
    ignored = re.compile(r"rotary_emb\.inv_freq$")
    # checkpoint module name -> ours, anywhere in a tensor's name (e.g. Mixtral's block_sparse_moe)
    renamed_modules: dict[str, str] = {}
    has_lm_head = True  # (an encoder has none: its hidden states are pooled)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def layer_windows(cls, cfg: ModelConfig) -> list[int | None]:
        """Each layer's attention: None (full) or its sliding window in tokens. The KV layout
        (pocketllm.core.kv_layout) is built from it, before the model is."""
        return [None] * cfg.num_layers

    @classmethod
    def kv_shape(cls, cfg: ModelConfig) -> KVShape:
        """What each layer's KV cache holds per token (all ranks' heads)."""
        return KVShape(cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def max_positions(cls, cfg: ModelConfig) -> int:
        """The longest sequence the model's positions cover."""
        return cfg.max_position_embeddings

    @classmethod
    def attention_kinds(cls, cfg: ModelConfig) -> set[str]:
        return {"full" if w is None else "sliding_window" for w in cls.layer_windows(cfg)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def reads_tensor(self, name: str) -> bool:
        """Whether loading reads a checkpoint tensor (by its name, before reading it)."""
        return True

    def attention_layers(self) -> list[torch.nn.Module]:
        """Each layer's attention, in layer order: what the KV cache binds to."""
        return [layer.self_attn for layer in self.model.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      groups: list[int] | None = None, scales: list[tuple] | None = None) -> None:
        """Per layer: its K and V caches (tensors shared by layers of different KV groups), the KV
        group whose block table it reads and, for an 8-bit cache, its (K, V) scales."""
        groups = groups or [0] * len(k_caches)
        scales = scales or [(None, None)] * len(k_caches)
        for attn, k, v, g, s in zip(self.attention_layers(), k_caches, v_caches, groups, scales, strict=True):
            attn.k_cache, attn.v_cache, attn.kv_group = k, v, g
            attn.k_scale, attn.v_scale = s

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        # On the CPU fast path the output projection (a tied one: the embedding table's) takes a
        # second 8-bit pass over its activations: its top logits decide the sampled token, and
        # 8 bits alone move the top-1 token at near ties (96.8% agreement with the exact path on
        # the default model, 97.5% with the second pass; benchmarks/results).
        head = getattr(self, "lm_head", None) or getattr(getattr(self, "model", None), "embed_tokens", None)
        if head is not None and getattr(head, "int8_activations", 0):
            head.int8_activations = 2
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.ignored.search(name):
                continue
            path, shard, kind = self.destination(name)
            if path == "lm_head" and self.cfg.tie_word_embeddings:
                continue
            try:
                module = self.get_submodule(path)
            except AttributeError:
                raise ConfigurationError(f"checkpoint tensor {name!r} matches no module of "
                                         f"{type(self).__name__}") from None
            if isinstance(tensor, Fp8Weight) and not isinstance(module, Linear):
                tensor = tensor.dequantize()  # (a Linear keeps or dequantizes its own; other modules read numbers)
            module.load(tensor, shard, kind)
            loaded.add(f"{path}:{shard}:{kind}")
        self._finish_loading(loaded)

    def destination(self, name: str) -> tuple[str, int, str]:
        """(module path, part of a fused module, "weight" or "bias") that checkpoint tensor `name` loads into."""
        for theirs, ours in self.renamed_modules.items():
            name = name.replace(f".{theirs}.", f".{ours}.")
        m = _SUFFIX.search(name)
        if m is None:
            raise ConfigurationError(f"unexpected checkpoint tensor {name!r}")
        kind, path = m.group(1), name[:m.start()]
        parent, _, leaf = path.rpartition(".")
        shard = 0
        if leaf in self.packed_modules:
            leaf, shard = self.packed_modules[leaf]
            path = f"{parent}.{leaf}" if parent else leaf
        return path, shard, kind

    def _finish_loading(self, loaded: set[str]) -> None:
        if self.cfg.tie_word_embeddings and self.has_lm_head:
            self.lm_head = self.model.embed_tokens.as_linear()
        missing = []
        for path, module in self.named_modules():
            if isinstance(module, (Linear, Embedding)):
                shards = len(module.out_sizes) if isinstance(module, Linear) else 1
                missing += [f"{path}[{i}]" for i in range(shards) if f"{path}:{i}:weight" not in loaded
                            and not (path == "lm_head" and self.cfg.tie_word_embeddings)]
            elif hasattr(module, "load") and f"{path}:0:weight" not in loaded and not getattr(module, "optional", False):
                missing.append(path)
        if missing:
            raise ConfigurationError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                                     + (" ..." if len(missing) > 8 else ""))
        unloaded = [n for n, p in self.named_parameters() if p.is_meta]  # every weight was built on meta and loaded
        assert not unloaded, f"weights never loaded: {unloaded[:8]}"
        for module in self.modules():  # layers that re-lay their weights once all are in (expert stacks)
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        # On the GPU the norms write their output's 8-bit form too where a GGUF GEMV reads it (any
        # projection's rows: a norm's consumer is the model's business, and the form costs ~K bytes a row)
        int8_rows = max((getattr(m, "int8_rows", 0) if isinstance(m, Linear) else getattr(m, "int8_tokens", 0)
                         for m in self.modules()), default=0)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.int8_rows = int8_rows
