"""Qwen3-MoE: Qwen3's attention (q/k norm) with a mixture of experts in place of the MLP on the
sparse layers (every `decoder_sparse_step`-th, none of `mlp_only_layers`)."""
from __future__ import annotations

import torch

from pocketllm.config import ModelConfig
from pocketllm.layers.moe import GROUPED_MAX_TOKENS, SparseMoE
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.models.llama import MLP
from pocketllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # Decode steps take the grouped expert path (no host sync): graphs up to its batch.
    capabilities = RuntimeCapabilities(cuda_graphs=True, cuda_graph_max_batch=GROUPED_MAX_TOKENS,
                                       expert_offload=True)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype, device) -> torch.nn.Module:
        step = cfg.raw.get("decoder_sparse_step") or 1
        if cfg.num_experts == 0 or layer in (cfg.raw.get("mlp_only_layers") or []) or (layer + 1) % step:
            return MLP(cfg, dtype, device)
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         lambda dev, dt: MLP(cfg, dt, dev, cfg.moe_intermediate_size, reduce=False), dtype, device)
