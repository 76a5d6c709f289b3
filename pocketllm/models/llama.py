"""The Llama family runtime: RMSNorm, GQA attention with rotary embeddings, gated MLP.
Qwen2 and Qwen3 reuse it with their differences as class attributes."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from pocketllm.config import ModelConfig
from pocketllm.distributed.parallel_state import get_tp
from pocketllm.kernels.platform import kernels_for
from pocketllm.layers.attention import AttentionMetadata, paged_attention
from pocketllm.layers.linear import Embedding, Linear
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.base import CausalLM
from pocketllm.models.capabilities import RuntimeCapabilities

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_KERNEL_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}  # codes of kernels.triton.fused


class Sinks(torch.nn.Module):
    """A learned logit per attention head that joins each softmax and attends to nothing (gpt-oss's
    `self_attn.sinks`); float32, as the scores it joins."""

    def __init__(self, heads: tuple[int, int], device):
        super().__init__()
        self.first = heads[0]  # this rank's query heads: (first, count)
        self.weight = torch.nn.Parameter(torch.zeros(heads[1], device=device), requires_grad=False)

    def load(self, tensor: torch.Tensor, shard: int = 0, kind: str = "weight") -> None:
        self.weight.data.copy_(tensor[self.first:self.first + self.weight.numel()])


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, dtype, device, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None, norm_offset: float = 0.0, sinks: bool = False):
        super().__init__()
        d, tp = cfg.head_dim, get_tp()
        (q0, hq), (kv0, hkv) = tp.split(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads)  # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.qkv_proj = Linear(cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
                               qkv_bias, dtype, device, parallel="column",
                               rows=[(q0 * d, hq * d), (kv0 * d, hkv * d), (kv0 * d, hkv * d)])
        self.o_proj = Linear(cfg.num_heads * d, [cfg.hidden_size], o_bias, dtype, device, parallel="row")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, norm_offset, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, norm_offset, dtype, device) if qk_norm else None
        self.rotary = rotary
        self.window, self.softcap = window, softcap
        self.scale = d ** -0.5 if scale is None else scale
        self.sinks = Sinks((q0, hq), device) if sinks else None
        self.k_cache = self.v_cache = None  # bound by the runner
        self.k_scale = self.v_scale = None  # an 8-bit cache's (pocketllm.core.kv_dtype), bound by the runner
        self.kv_group = 0  # the KV group whose block table this layer reads (bound by the runner)
        self.kernels = kernels_for(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.kv_group:
            meta = meta.groups[self.kv_group]
        t, hq = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :hq + self.num_kv_heads], qkv[:, hq + self.num_kv_heads:]
        norms = None
        if self.q_norm is not None and self.kernels.gpu:  # normed by the rotary kernel, in place
            norms = (self.q_norm.weight, self.k_norm.weight, hq, self.q_norm.eps, self.q_norm.offset)
        elif self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        fast = self.kernels.cpu_fused  # the cache write and decode attention in C
        sinks = None if self.sinks is None else self.sinks.weight
        if fast and meta.cpu_decode_only:  # rotary, cache write and attention: one call
            from pocketllm.kernels.cpu import layer_ops

            if self.q_norm is not None:
                qkv[:, :hq + self.num_kv_heads] = qk
            rot = self.rotary
            o = layer_ops.fused_decode_attention(qkv, hq, self.k_cache, self.v_cache, meta.slot_mapping,
                                                 meta.decode_block_tables, meta.decode_lens, self.scale,
                                                 self.window, self.softcap, (positions, rot.cos, rot.sin), sinks,
                                                 self.k_scale, self.v_scale)
            return self.o_proj(o.reshape(t, -1))
        kv = None  # on the attention kernels' path the rotary kernel writes the cache too: one launch less
        if meta.block_tables is not None and self.k_cache.dtype == qkv.dtype:
            kv = (v, self.k_cache, self.v_cache, meta.slot_mapping)
        qk = self.rotary(positions, qk, norms, kv)  # queries and keys rotate in one pass
        q, k = qk[:, :hq], qk[:, hq:]
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window, self.softcap,
                            fast, sinks, self.o_proj.int8_rows, kv_written=kv is not None, k_scale=self.k_scale,
                            v_scale=self.v_scale)
        if self.kernels.gpu:  # the 8-bit form attention's split merge wrote goes along (int8_act)
            from pocketllm.kernels.triton.int8_act import flattened

            return self.o_proj(flattened(o))
        return self.o_proj(o.reshape(t, -1))


class MLP(torch.nn.Module):
    """``reduce``: sum the tensor-parallel ranks' outputs here (False for experts: their layer sums once)."""

    def __init__(self, cfg: ModelConfig, dtype, device, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(h, [i, i], cfg.mlp_bias, dtype, device, parallel="column")
        self.down_proj = Linear(i, [h], cfg.mlp_bias, dtype, device, parallel="row", reduce=reduce)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.act_code = _KERNEL_ACTIVATIONS[cfg.hidden_act]
        self.kernels = kernels_for(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x), int8_rows=self.down_proj.int8_rows))

    def activation(self, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                   ids: torch.Tensor | None = None, int8_rows: int = 0) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> act(gate) * up [T, I]; on CUDA ``bias`` [E, 2I]: row ids[t] added
        to row t first (the experts' biases of a mixture-of-experts layer's pairs), and up to
        ``int8_rows`` rows the result's 8-bit form for the GEMV that reads it (``int8_act``)."""
        if self.kernels.gpu:
            from pocketllm.kernels.triton.fused import gated_act

            return gated_act(gate_up, self.act_code, bias=bias, ids=ids, int8_rows=int8_rows)
        assert bias is None, "expert biases in the activation: the CUDA kernel's"
        if self.kernels.cpu_fused and self.act_code in (0, 1):  # (the fast path's activations)
            from pocketllm.kernels.cpu import layer_ops

            return layer_ops.gated_act(gate_up, self.act_code)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: torch.nn.Module, dtype, device):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)


class LlamaForCausalLM(CausalLM):
    capabilities = RuntimeCapabilities(cuda_graphs=True)
    qkv_bias: bool | None = None  # None: follow the config's attention_bias
    o_bias: bool | None = None
    qk_norm = False

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu", max_model_len: int = 2048):
        super().__init__(cfg)
        rotary = RotaryEmbedding(self.rotary_dim(cfg), max_model_len, cfg.rope_theta, cfg.rope_scaling, device)
        qkv_bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = cfg.attention_bias if self.o_bias is None else self.o_bias
        layers = [DecoderLayer(cfg, self.make_attention(cfg, i, rotary, qkv_bias, o_bias, dtype, device),
                               self.make_mlp(cfg, i, dtype, device), dtype, device) for i in range(cfg.num_layers)]
        self.model = LlamaModel(cfg, layers, dtype, device)
        self.rotary = rotary
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], dtype=dtype, device=device, parallel="column",
                                  gather=True)
        self.kernels = kernels_for(device)  # the CPU fast path: decode-only steps' layers in one C call
        self._cpu_decoder = None  # built at the first such step (the KV cache is bound by then)
        self.lora_rows = None  # LoRA adapters (layers.lora): the step's rows' slots, for the one-call decoder

    @classmethod
    def rotary_dim(cls, cfg: ModelConfig) -> int:
        """The dimensions of a head that rotate (runtimes whose heads rotate only part override this)."""
        return cfg.head_dim

    def make_attention(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                       dtype, device) -> Attention:
        """Layer ``layer``'s attention (runtimes with per-layer windows or sinks override this)."""
        return Attention(cfg, rotary, qkv_bias, o_bias, self.qk_norm, dtype, device)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype, device) -> torch.nn.Module:
        """Layer ``layer``'s feed-forward block (mixture-of-experts runtimes override this)."""
        return MLP(cfg, dtype, device)

    def forward(self, input_ids, positions, meta):
        x = self.model.embed_tokens(input_ids)
        decoder = self._decoder() if self.kernels.cpu_fused and meta.decode_lens is not None else None
        if decoder is not None and meta.prefills:
            # A mixed step: its decode rows in the one call (the bits a decode-only step computes, and
            # 2-3x faster than the layers' masked attention over 64 rows), its chunks through the layers.
            n = meta.num_decodes
            decodes, chunks = meta.split_decodes()
            xd, rd = decoder(x[:n], positions[:n], decodes)
            with self.lora_rows.after(n) if self.lora_rows is not None else contextlib.nullcontext():
                xc, rc = self._layers(x[n:], positions[n:], chunks)
            x, residual = torch.cat([xd, xc]), torch.cat([rd, rc])
        elif decoder is not None:
            x, residual = decoder(x, positions, meta)
        else:
            x, residual = self._layers(x, positions, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def _layers(self, x, positions, meta):
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, meta)
        return x, residual

    def bind_kv_cache(self, k_caches, v_caches, groups=None, scales=None) -> None:
        super().bind_kv_cache(k_caches, v_caches, groups, scales)
        self._cpu_decoder = None  # it points at the caches

    def _decoder(self):
        if self._cpu_decoder is None:
            from pocketllm.kernels.cpu.llama_decode import LlamaDecoder

            self._cpu_decoder = LlamaDecoder.build(self) or False  # False: not covered, the modules run
        return self._cpu_decoder or None
