"""Mixtral: the Llama op sequence with a mixture of experts in every layer (top-2 of 8 in the
released models; the two router probabilities renormalised)."""
from __future__ import annotations

import torch

from pocketllm.config import ModelConfig
from pocketllm.layers.moe import GROUPED_MAX_TOKENS, SparseMoE
from pocketllm.models.base import CausalLM
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.models.llama import MLP, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    # Decode steps take the grouped expert path (no host sync): graphs up to its batch.
    capabilities = RuntimeCapabilities(cuda_graphs=True, cuda_graph_max_batch=GROUPED_MAX_TOKENS,
                                       expert_offload=True)
    # experts.{e}.w1 / w3 / w2: gate, up, down
    packed_modules = {**CausalLM.packed_modules,
                      "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
    renamed_modules = {"block_sparse_moe": "mlp"}

    @classmethod
    def layer_windows(cls, cfg: ModelConfig) -> list[int | None]:
        return [cfg.raw.get("sliding_window")] * cfg.num_layers  # refused by the capabilities when set

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype, device) -> torch.nn.Module:
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, True,
                         lambda dev, dt: MLP(cfg, dt, dev, reduce=False), dtype, device)
