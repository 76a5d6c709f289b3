"""DeepSeek-V2 and V3 (Kimi K2, Moonlight): multi-head latent attention and a mixture of experts with
shared experts and grouped routing.

Multi-head latent attention (MLA). Each token's keys and values come from one compressed latent `c`
(`kv_lora_rank` values, normed) and one rotary key `k_pe` shared by all heads (`qk_rope_head_dim`
values): head h's key is [c @ W_UK[h] | k_pe], its value c @ W_UV[h] (W_UK, W_UV: the two halves of
`kv_b_proj`). The cache keeps only [c | k_pe], one "head" of `kv_lora_rank + qk_rope_head_dim` values
a token (576 for V3, where Llama-3-70B's GQA keeps 2,048), in one tensor read as keys and as values
(`KVShape.shared`). The attention runs over it directly with W_UK absorbed into the query
(q_h . k_h = (q_nope_h @ W_UK[h]^T) . c + q_pe_h . k_pe) and W_UV applied to its output (the weighted
sum of the latents, then @ W_UV[h]): multi-query attention of `num_heads` heads over one latent head,
on the paged attention kernels every runtime uses. The value read is the whole latent row (its rotary
tail too); those extra output columns are dropped.

DeepSeek's rotary dimensions rotate interleaved pairs (x0, x1), (x2, x3), ...; the queries' and keys'
rotary parts are de-interleaved before the rotate-half rotation, which leaves every q . k unchanged.
YaRN's `mscale_all_dim` also scales the softmax (transformers' `yarn_apply_mscale`).

The MoE layers (from `first_k_dense_replace`, every `moe_layer_freq`-th) route as the two versions do:
V2 takes a softmax over the experts, then the top k (within the `topk_group` best of `n_group` groups
by their best expert, for `group_limited_greedy`); V3 scores with a sigmoid, chooses with each
expert's `e_score_correction_bias` added (groups ranked by their two best), and weights by the plain
scores. The weights are renormalised when `norm_topk_prob`, then multiplied by `routed_scaling_factor`;
the shared experts (one MLP `n_shared_experts` times as wide) see every token.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import torch

from pocketllm.config import ModelConfig
from pocketllm.core.gguf_types import row_nbytes
from pocketllm.core.kv_layout import KVShape
from pocketllm.kernels import dispatch
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.kernels.platform import KernelConfig, kernels_for
from pocketllm.layers.attention import AttentionMetadata, paged_attention
from pocketllm.layers.linear import Linear, QuantizedTensor
from pocketllm.layers.moe import GROUPED_MAX_TOKENS, OneCallRouting, SparseMoE
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.base import CausalLM
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.models.llama import MLP, DecoderLayer, LlamaForCausalLM


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    raw = cfg.raw
    scale = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _score_correction(name: str) -> str:
    """V3's e_score_correction_bias (a GGUF's exp_probs_b.bias reads as e_score_correction.bias) as ScoreCorrection's."""
    return re.sub(r"\.gate\.e_score_correction[._]bias$", ".score_correction.weight", name)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...] (rotate-half's layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class QuantizedHeads(torch.nn.Module):
    """A deepseek2 GGUF file's own W_UK and W_UV in its encoding: attn_k_b [H, rank, nope] (each head's
    W_UK, transposed) and attn_v_b [H, v, rank]. On the CPU's fast path the absorbed products multiply
    them over 8-bit activations where the CPU table (`dispatch.cpu_gguf_kernel`) takes the integer
    kernels, as llama.cpp multiplies them: 4-6 bits a weight read where kv_b_proj's dense halves take
    32. Elsewhere (the GPU, the exact kernels, float files, safetensors checkpoints) nothing is kept and
    kv_b_proj serves."""

    optional = True  # (a checkpoint without the two tensors loads kv_b_proj alone)

    def __init__(self, num_heads: int, kernels: KernelConfig):
        super().__init__()
        self.num_heads, self.passes = num_heads, kernels.int8_passes
        self.parts: list[tuple | None] = [None, None]  # (raw rows, pointer table, type, rows a head, columns)

    def load(self, tensor, shard: int = 0, kind: str = "weight") -> None:
        if not self.passes or not isinstance(tensor, QuantizedTensor) or not gguf_ops.supports_int8(tensor.qtype):
            return
        h, n, k = tensor.shape
        assert h == self.num_heads, (tensor.shape, self.num_heads)
        raw = tensor.data.reshape(h * n, row_nbytes(tensor.qtype, k))  # (a view of the file)
        self.parts[shard] = (raw, gguf_ops.row_pointers([raw]), tensor.qtype, n, k)

    def kept(self, rows: int) -> bool:
        """Whether `rows` activation rows take the integer kernels here (both halves kept)."""
        return all(p is not None and dispatch.cpu_gguf_kernel(rows, self.num_heads * p[3] * p[4], passes=self.passes,
                                                              interleaved=False) == "gemm" for p in self.parts)

    def forward(self, x: torch.Tensor, shard: int) -> torch.Tensor:
        """x [T, H, K] -> [T, H, N] through head h's own matrix of half `shard` (0: W_UK, 1: W_UV)."""
        _, rows, qtype, n, k = self.parts[shard]
        assert x.shape[1:] == (self.num_heads, k), (x.shape, self.num_heads, k)  # (the kernel reads K values a row)
        return gguf_ops.heads_gemm(x.transpose(0, 1), rows, n, qtype, self.passes).transpose(0, 1)


class LatentAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype, device):
        super().__init__()
        raw = cfg.raw
        self.num_heads = cfg.num_heads
        self.nope, self.rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        self.rank, self.v_dim = raw["kv_lora_rank"], raw["v_head_dim"]
        self.interleaved = raw.get("rope_interleave", True) is not False
        h, bias = cfg.hidden_size, cfg.attention_bias
        q_width = self.num_heads * (self.nope + self.rope)
        self.q_lora_rank = raw.get("q_lora_rank")
        if self.q_lora_rank:  # V3 and V2: the query through its own low-rank bottleneck
            self.q_a_proj = Linear(h, [self.q_lora_rank], bias, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = Linear(self.q_lora_rank, [q_width], False, dtype, device)
        else:  # V2-Lite
            self.q_proj = Linear(h, [q_width], False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(h, [self.rank + self.rope], bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.kv_b_proj = Linear(self.rank, [self.num_heads * (self.nope + self.v_dim)], False, dtype, device)
        self.kv_b_proj.keeps_fp8 = False  # (read as W_UK and W_UV)
        self.o_proj = Linear(self.num_heads * self.v_dim, [h], bias, dtype, device)
        self.rotary = rotary
        self.scale = softmax_scale(cfg)
        self.w_uk = self.w_uv = None  # [H, nope, rank], [H, v, rank]: kv_b_proj's halves, after loading
        self.window = None
        self.k_cache = self.v_cache = None  # the one latent cache, bound as both by the runner
        self.k_scale = self.v_scale = None
        self.kv_group = 0
        self.kernels = kernels_for(device)
        self.heads = QuantizedHeads(self.num_heads, self.kernels)

    def finish_loading(self) -> None:
        # views of the weight, no second copy (every loader gives kv_b_proj dense: GGUF's is dequantized at load)
        assert self.kv_b_proj.quantized is None, "kv_b_proj is read as W_UK and W_UV: dense"
        w = self.kv_b_proj.weight.data.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk, self.w_uv = w[:, :self.nope], w[:, self.nope:]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, hq = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(t, hq, self.nope + self.rope)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        pe = torch.cat((q[..., self.nope:], k_pe.view(t, 1, self.rope)), dim=1)  # [T, H + 1, rope]
        pe = self.rotary(positions, _deinterleave(pe) if self.interleaved else pe.contiguous())
        latent = torch.cat((self.kv_a_layernorm(c.contiguous()), pe[:, hq]), dim=-1).view(t, 1, -1)
        quantized = self.heads.kept(t)
        if quantized:
            q_latent = self.heads(q[..., :self.nope], 0)
        else:
            q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, pe[:, :hq]), dim=-1)
        # (the CPU fast path: the cache write and decode rows' attention in C, one latent head for all)
        o = paged_attention(query, latent, latent, self.k_cache, self.v_cache, meta, self.scale,
                            cpu_fused=self.kernels.cpu_fused)[..., :self.rank]
        if quantized:
            o = self.heads(o, 1)  # [T, H, v]
        else:
            o = torch.bmm(o.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(o.reshape(t, hq * self.v_dim))


class ScoreCorrection(torch.nn.Module):
    """V3's `e_score_correction_bias`: added to the scores that choose the experts, not to their weights."""

    def __init__(self, num_experts: int, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, device=device), requires_grad=False)

    def load(self, tensor: torch.Tensor, shard: int = 0, kind: str = "weight") -> None:
        self.weight.data.copy_(tensor)


class DeepseekMoE(SparseMoE):
    """Routed experts (SparseMoE's paths: grouped, sorted, fused, in host memory) routed as V2 or V3 route
    (`sigmoid`), plus the shared experts every token goes through."""

    def __init__(self, cfg: ModelConfig, sigmoid: bool, dtype, device):
        raw = cfg.raw
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         lambda dev, dt: MLP(cfg, dt, dev, cfg.moe_intermediate_size, reduce=False), dtype, device)
        self.sigmoid = sigmoid
        self.greedy = not sigmoid and raw.get("topk_method", "greedy") == "greedy"
        self.groups, self.top_groups = raw.get("n_group") or 1, raw.get("topk_group") or 1
        self.scaling = float(raw.get("routed_scaling_factor") or 1.0)
        self.score_correction = ScoreCorrection(cfg.num_experts, device) if sigmoid else None
        shared = raw.get("n_shared_experts") or 0
        self.shared_experts = MLP(cfg, dtype, device, cfg.moe_intermediate_size * shared, reduce=False) \
            if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        t, e = logits.shape
        if self.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.score_correction.weight
            group_scores = choice.view(t, self.groups, e // self.groups).topk(2, dim=-1)[0].sum(-1)
        else:
            scores = choice = torch.softmax(logits, dim=-1)
            group_scores = None if self.greedy else choice.view(t, self.groups, e // self.groups).amax(-1)
        if group_scores is not None:
            best = torch.topk(group_scores, self.top_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand(t, self.groups, e // self.groups).reshape(t, e)
            choice = choice.masked_fill(~keep, float("-inf") if self.sigmoid else 0.0)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def one_call_routing(self) -> OneCallRouting | None:
        if not self._one_call_router():
            return None
        bias = None if self.score_correction is None else self.score_correction.weight.data.contiguous()
        return OneCallRouting(self.gate.weight.data.contiguous(), self.top_k, self.renormalize, self.sigmoid, bias,
                              1 if self.greedy else self.groups, self.top_groups, self.scaling)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # one latent head a layer, not split over ranks; the latent cache in the model's dtype
    capabilities = RuntimeCapabilities(cuda_graphs=True, cuda_graph_max_batch=GROUPED_MAX_TOKENS,
                                       expert_offload=True, tensor_parallel=False,
                                       kv_cache_dtypes=frozenset({"auto"}))
    sigmoid_routing = False
    # (q_proj is the latent attention's own: no fused QKV)
    # (a GGUF file's attn_k_b / attn_v_b come twice: joined, dense, as kv_b_proj; and as they are, QuantizedHeads')
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "k_b": ("heads", 0), "v_b": ("heads", 1)}

    @classmethod
    def kv_shape(cls, cfg: ModelConfig) -> KVShape:
        return KVShape(1, cfg.raw["kv_lora_rank"] + cfg.raw["qk_rope_head_dim"], shared=True)

    @classmethod
    def rotary_dim(cls, cfg: ModelConfig) -> int:
        return cfg.raw["qk_rope_head_dim"]

    def make_attention(self, cfg, layer, rotary, qkv_bias, o_bias, dtype, device) -> LatentAttention:
        return LatentAttention(cfg, rotary, dtype, device)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype, device) -> torch.nn.Module:
        raw = cfg.raw
        dense = layer < (raw.get("first_k_dense_replace") or 0) or layer % (raw.get("moe_layer_freq") or 1)
        if not cfg.num_experts or dense:
            return MLP(cfg, dtype, device)
        return DeepseekMoE(cfg, self.sigmoid_routing, dtype, device)

    def load_weights(self, weights) -> None:
        super().load_weights((_score_correction(name), t) for name, t in weights if self.reads_tensor(name))

    def reads_tensor(self, name: str) -> bool:
        """Not V3's next-token-prediction layers (past the last decoder layer, `num_nextn_predict_layers` of
        them): DeepseekMTP reads the first when it drafts."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is None or int(m.group(1)) < self.cfg.num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    capabilities = replace(DeepseekV2ForCausalLM.capabilities, next_token_drafts=True)
    sigmoid_routing = True

    def draft_module(self, **kwargs) -> DeepseekMTP:
        """The first next-token-prediction layer over this model (built empty: its weights load next)."""
        return DeepseekMTP(self.cfg, self, **kwargs)


class DeepseekMTP(CausalLM):
    """DeepSeek-V3's next-token-prediction (MTP) layer, drafting for its model (speculative method "mtp").

    At position i it reads the model's final hidden state h_i (`previous_hidden`, a row per input row)
    and the embedding of token i + 1, each RMS-normed and joined by `eh_proj` ([embedding | hidden], as
    vLLM and SGLang order them), runs one decoder layer (latent attention over a one-layer cache on the
    model's block ids, MoE), and predicts token i + 2 through the model's output head after its own
    norm. The embedding and the head are the model's (DeepSeek shares them; the checkpoint's copies are
    not read). `forward` returns the layer's output before that norm: it stands in for h at the next
    position when drafts are chained."""

    capabilities = DeepseekV2ForCausalLM.capabilities
    packed_modules = DeepseekV2ForCausalLM.packed_modules
    has_lm_head = False
    kv_shape = DeepseekV2ForCausalLM.kv_shape

    def __init__(self, cfg: ModelConfig, target: DeepseekV2ForCausalLM, dtype=torch.float32, device="cpu",
                 max_model_len: int = 2048):
        super().__init__(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.eh_proj = Linear(2 * h, [h], False, dtype, device)
        self.layer = DecoderLayer(cfg, LatentAttention(cfg, target.rotary, dtype, device),
                                  target.make_mlp(cfg, cfg.num_layers, dtype, device), dtype, device)
        self.shared_head_norm = RMSNorm(h, eps, dtype=dtype, device=device)
        self._target = (target,)  # (not a submodule: its weights are the model's)
        self.previous_hidden: torch.Tensor | None = None  # [T, H], set before each forward

    def forward(self, input_ids, positions, meta):
        target, h = self._target[0], self.previous_hidden
        assert h is not None and h.shape[0] == input_ids.shape[0], "a previous hidden state for each row"
        x = torch.cat((self.enorm(target.model.embed_tokens(input_ids)), self.hnorm(h.to(self.eh_proj.dtype))), -1)
        x, residual = self.layer(positions, self.eh_proj(x), None, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(self.shared_head_norm(hidden))

    def attention_layers(self) -> list[torch.nn.Module]:
        return [self.layer.self_attn]

    def reads_tensor(self, name: str) -> bool:
        """Whether loading reads a checkpoint tensor: the first next-token layer's, but its copies of the
        model's embedding and head."""
        prefix = f"model.layers.{self.cfg.num_layers}."
        return name.startswith(prefix) and not name[len(prefix):].startswith(("embed_tokens.", "shared_head.head."))

    def load_weights(self, weights) -> None:
        prefix = f"model.layers.{self.cfg.num_layers}."

        def ours(name: str) -> str:
            name = name[len(prefix):].replace("shared_head.norm.", "shared_head_norm.")
            if not name.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head_norm.")):
                name = "layer." + name
            return _score_correction(name)

        # (random weights come under our own names)
        super().load_weights((ours(n), t) if n.startswith(prefix) else (n, t) for n, t in weights
                             if self.reads_tensor(n) or not n.startswith("model."))
