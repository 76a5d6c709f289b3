"""Gemma 3 text models: interleaved sliding-window and global attention layers with their own
rotary bases, q/k RMSNorm, GeGLU, a scaled embedding and four norms per layer (Gemma's
RMSNorm multiplies by 1 + w).

KV memory: the sliding-window layers form their own KV groups (pocketllm.core.kv_layout), whose
block tables keep only the window (`sliding_window_kv="window"`); the global layers keep the whole
sequence.
"""
from __future__ import annotations

import math

import torch

from pocketllm.config import ModelConfig
from pocketllm.layers.linear import Embedding
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.base import CausalLM, sliding_windows
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.models.llama import MLP, Attention


def layer_types(cfg: ModelConfig) -> list[str]:
    raw = cfg.raw
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_layers)]


def rope_settings(cfg: ModelConfig) -> dict[str, tuple[float, dict | None]]:
    """layer type -> (theta, scaling). transformers >= 5 nests them per layer type."""
    params = cfg.raw.get("rope_parameters") or {}
    if "full_attention" in params:
        out = {}
        for kind, p in params.items():
            p = dict(p)
            theta = float(p.pop("rope_theta"))
            out[kind] = (theta, p if p.get("rope_type", "default") != "default" else None)
        return out
    scaling = cfg.raw.get("rope_scaling")
    if scaling:
        scaling = {**scaling, "rope_type": scaling.get("rope_type") or scaling.get("type")}
    return {"full_attention": (cfg.rope_theta, scaling),
            "sliding_attention": (float(cfg.raw.get("rope_local_base_freq", 10000.0)), None)}


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, attn: Attention, dtype, device):
        super().__init__()
        self.self_attn = attn
        self.mlp = MLP(cfg, dtype, device)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0, dtype, device)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, x, meta):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layers, dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0, dtype, device)


class Gemma3ForCausalLM(CausalLM):
    capabilities = RuntimeCapabilities(attention_kinds=frozenset({"full", "sliding_window"}), cuda_graphs=True,
                                       sliding_window_kv="window")

    @classmethod
    def layer_windows(cls, cfg: ModelConfig) -> list[int | None]:
        return sliding_windows(cfg, layer_types(cfg))

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu", max_model_len: int = 2048):
        super().__init__(cfg)
        raw = cfg.raw
        scale = float(raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        ropes = {kind: RotaryEmbedding(cfg.head_dim, max_model_len, theta, scaling, device)
                 for kind, (theta, scaling) in rope_settings(cfg).items()}
        self.types = layer_types(cfg)
        layers = []
        for kind, window in zip(self.types, self.layer_windows(cfg)):
            attn = Attention(cfg, ropes[kind], cfg.attention_bias, cfg.attention_bias, True, dtype, device,
                             window=window, scale=scale,
                             softcap=raw.get("attn_logit_softcapping"), norm_offset=1.0)
            layers.append(Gemma3DecoderLayer(cfg, attn, dtype, device))
        self.model = Gemma3Model(cfg, layers, dtype, device)
        self.ropes = torch.nn.ModuleDict(ropes)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.final_softcap = raw.get("final_logit_softcapping")
        if not cfg.tie_word_embeddings:
            from pocketllm.layers.linear import Linear
            self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], dtype=dtype, device=device, parallel="column",
                                  gather=True)

    def forward(self, input_ids, positions, meta):
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layer in self.model.layers:
            x = layer(positions, x, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
