"""BERT-family encoders for embeddings: BertModel, RobertaModel and XLMRobertaModel (learned absolute
positions, biased projections, a GELU MLP) and Nomic BERT (rotary positions, no biases, a SwiGLU MLP), all
with token types, bidirectional attention over each whole prompt and post-norm blocks. A prompt is
computed in one step and pooled (task embed); the runtime keeps no KV cache."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from pocketllm.config import ModelConfig
from pocketllm.layers.attention import AttentionMetadata
from pocketllm.layers.linear import Embedding, Linear
from pocketllm.layers.norm import LayerNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.base import CausalLM
from pocketllm.models.capabilities import RuntimeCapabilities

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def row_spans(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(first token, tokens) of each row of the step: each a whole prompt (an encoder's prompt is never
    chunked), the one-token ones first."""
    if meta.query_start_loc is not None:  # the kernel path's flat metadata
        starts = meta.query_start_loc.tolist()
        return [(a, b - a) for a, b in zip(starts, starts[1:])]
    return [(i, 1) for i in range(meta.num_decodes)] + [(p.query_start, p.query_len) for p in meta.prefills]


class SelfAttention(torch.nn.Module):
    window = None  # (every token sees the whole prompt)

    def __init__(self, cfg: ModelConfig, kind: type[BertModel], rotary: RotaryEmbedding | None, dtype, device):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        parts = [3 * cfg.hidden_size] if kind.fused_qkv else [cfg.hidden_size] * 3
        self.qkv = Linear(cfg.hidden_size, parts, bias=kind.biases, dtype=dtype, device=device)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, 3 * self.heads, self.head_dim)
        if self.rotary is not None:  # queries and keys, rotated as one [T, 2H, D] tensor
            qkv = torch.cat((self.rotary(positions, qkv[:, :2 * self.heads].contiguous()), qkv[:, 2 * self.heads:]), 1)
        q, k, v = qkv.view(t, 3, self.heads, self.head_dim).unbind(1)
        out = torch.empty_like(q)
        for start, n in spans:
            rows = slice(start, start + n)
            out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                                       v[rows].transpose(0, 1)).transpose(0, 1)
        return out.reshape(t, -1)


class Dense(torch.nn.Module):
    """A projection (a gated pair with `gate`), optionally followed by a residual add and LayerNorm
    (BERT's *.output blocks)."""

    def __init__(self, cfg: ModelConfig, n_in: int, n_out: int, norm: bool, bias: bool, dtype, device,
                 gate: bool = False):
        super().__init__()
        self.dense = Linear(n_in, [n_out], bias=bias, dtype=dtype, device=device)
        self.gate = Linear(n_in, [n_out], bias=bias, dtype=dtype, device=device) if gate else None
        self.LayerNorm = LayerNorm(n_out, cfg.raw.get("layer_norm_eps", 1e-12), dtype, device) if norm else None


class AttentionBlock(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, kind: type[BertModel], rotary: RotaryEmbedding | None, dtype, device):
        super().__init__()
        self.self = SelfAttention(cfg, kind, rotary, dtype, device)
        self.output = Dense(cfg, cfg.hidden_size, cfg.hidden_size, True, kind.biases, dtype, device)


class EncoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, kind: type[BertModel], rotary: RotaryEmbedding | None, dtype, device):
        super().__init__()
        self.attention = AttentionBlock(cfg, kind, rotary, dtype, device)
        self.intermediate = Dense(cfg, cfg.hidden_size, cfg.intermediate_size, False, kind.biases, dtype, device,
                                  gate=kind.gated_mlp)
        self.output = Dense(cfg, cfg.intermediate_size, cfg.hidden_size, True, kind.biases, dtype, device)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    @property
    def self_attn(self) -> SelfAttention:
        return self.attention.self

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        a, up = self.attention, self.intermediate
        x = a.output.LayerNorm(x + a.output.dense(a.self(x, positions, spans)))
        h = self.act(up.dense(x)) if up.gate is None else self.act(up.gate(x)) * up.dense(x)
        return self.output.LayerNorm(x + self.output.dense(h))


class Embeddings(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, learned_positions: bool, dtype, device):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.position_embeddings = (Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype, device)
                                    if learned_positions else None)
        self.token_type_embeddings = Embedding(cfg.raw.get("type_vocab_size", 2), cfg.hidden_size, dtype, device)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.raw.get("layer_norm_eps", 1e-12), dtype, device)


class Encoder(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, kind: type[BertModel], rotary: RotaryEmbedding | None, dtype, device):
        super().__init__()
        self.layer = torch.nn.ModuleList(EncoderLayer(cfg, kind, rotary, dtype, device) for _ in range(cfg.num_layers))


class BertModel(CausalLM):
    capabilities = RuntimeCapabilities(encoder=True, lora=False, prefix_caching=False, tensor_parallel=False,
                                       kv_cache_dtypes=frozenset({"auto"}), rope_scaling=frozenset({"default"}))
    packed_modules = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
    # the masked-LM and pooler heads, and buffers some checkpoints keep
    ignored = re.compile(r"^(cls|lm_head|pooler)\.|position_ids$|\.(gamma|beta)$")
    has_lm_head = False
    position_offset = 0  # RoBERTa counts positions from padding_idx + 1
    rotary_positions = False  # rotary queries and keys instead of a learned position table
    biases = True  # on every projection
    gated_mlp = False  # act(gate(x)) * up(x), not act(up(x))
    fused_qkv = False  # the checkpoint holds one QKV matrix, not three

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu", max_model_len: int = 512):
        super().__init__(cfg)
        rotary = (RotaryEmbedding(cfg.head_dim, max(max_model_len, 1), cfg.rope_theta, None, device)
                  if self.rotary_positions else None)
        self.embeddings = Embeddings(cfg, not self.rotary_positions, dtype, device)
        self.encoder = Encoder(cfg, type(self), rotary, dtype, device)

    @classmethod
    def max_positions(cls, cfg: ModelConfig) -> int:
        return cfg.max_position_embeddings - cls.position_offset

    def attention_layers(self) -> list[torch.nn.Module]:
        return []  # (no KV cache to bind)

    def bind_kv_cache(self, k_caches, v_caches, groups=None, scales=None) -> None:
        pass

    def load_weights(self, weights) -> None:
        prefix = re.compile(r"^(bert|roberta|model)\.")  # a task model's encoder, as the bare one names it
        super().load_weights((prefix.sub("", name), tensor) for name, tensor in weights)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.token_type_embeddings(torch.zeros_like(input_ids))
        if e.position_embeddings is not None:
            x = x + e.position_embeddings(positions + self.position_offset)
        x = e.LayerNorm(x)
        spans = row_spans(meta)
        for layer in self.encoder.layer:
            x = layer(x, positions, spans)
        return x


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT with positions counted from padding_idx + 1 (a prompt holds no padding)."""

    position_offset = 2  # (every released checkpoint's pad_token_id is 1)


class NomicBertModel(BertModel):
    """Nomic BERT (nomic-embed-text): rotary positions (rotate-half), a SwiGLU MLP, no biases, one QKV matrix."""

    rotary_positions = True
    biases = False
    gated_mlp = True
    fused_qkv = True
