"""gpt-oss: attention with biases and a learned sink logit per head, sliding-window layers
alternating with full ones (`layer_types`; their KV groups keep only the window), YaRN rope, and
a mixture of experts whose router takes the top k logits before its softmax, with biased experts
and a clamped SwiGLU.

Checkpoints hold the experts fused, x @ W style: `mlp.experts.gate_up_proj` [experts, hidden,
2 * inter] with gate and up columns interleaved, `down_proj` [experts, inter, hidden], and their
biases. They are split here into each expert's gate, up and down `Linear` weights. The released
checkpoints hold them in MXFP4 instead (`<proj>_blocks` [experts, rows, in / 32, 16] of packed
4-bit codes, `<proj>_scales` [experts, rows, in / 32] of E8M0 exponents, rows = out): those are
re-packed, bit for bit, into GGUF's MXFP4 blocks and stay quantized.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType

from pocketllm.config import ModelConfig
from pocketllm.kernels.platform import kernels_for
from pocketllm.layers.linear import Linear, QuantizedTensor
from pocketllm.layers.moe import GROUPED_MAX_TOKENS, SparseMoE
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.base import sliding_windows
from pocketllm.models.capabilities import RuntimeCapabilities
from pocketllm.models.llama import Attention, LlamaForCausalLM


class GptOssExpert(torch.nn.Module):
    """down(clamp(up) + 1) * g * sigmoid(alpha * g)), g = min(gate, limit): transformers' GptOssExperts
    for one expert."""

    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = Linear(h, [i, i], True, dtype, device, parallel="column")
        self.down_proj = Linear(i, [h], True, dtype, device, parallel="row", reduce=False)  # the MoE layer sums
        self.alpha = float(cfg.raw.get("swiglu_alpha", 1.702))
        self.limit = float(cfg.raw.get("swiglu_limit", 7.0))
        self.act_code = 3  # kernels.triton.fused.CLAMPED_SWIGLU, and the CPU's one-call experts
        self.kernels = kernels_for(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x), int8_rows=self.down_proj.int8_rows))

    def activation(self, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                   ids: torch.Tensor | None = None, int8_rows: int = 0) -> torch.Tensor:
        """As `MLP.activation`, clamped SwiGLU."""
        if self.kernels.gpu:
            from pocketllm.kernels.triton.fused import gated_act

            return gated_act(gate_up, self.act_code, self.alpha, self.limit, bias, ids, int8_rows)
        assert bias is None, "expert biases in the activation: the CUDA kernel's"
        if self.kernels.cpu_fused and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
            from pocketllm.kernels.cpu import layer_ops

            return layer_ops.clamped_swiglu(gate_up, self.alpha, self.limit)
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssForCausalLM(LlamaForCausalLM):
    # Decode steps take the grouped expert path (no host sync): graphs up to its batch.
    capabilities = RuntimeCapabilities(attention_kinds=frozenset({"full", "sliding_window"}), cuda_graphs=True,
                                       cuda_graph_max_batch=GROUPED_MAX_TOKENS, sliding_window_kv="window",
                                       expert_offload=True)
    qkv_bias = o_bias = True
    renamed_modules = {"router": "gate"}

    @classmethod
    def layer_windows(cls, cfg: ModelConfig) -> list[int | None]:
        return sliding_windows(cfg, _layer_types(cfg))

    def make_attention(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                       dtype, device) -> Attention:
        return Attention(cfg, rotary, qkv_bias, o_bias, False, dtype, device, window=self.layer_windows(cfg)[layer],
                         sinks=True)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype, device) -> torch.nn.Module:
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, False,
                         lambda dev, dt: GptOssExpert(cfg, dt, dev), dtype, device, router_bias=True,
                         softmax_of_top_k=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(_split_experts(weights))


def _layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.raw.get("layer_types")
    if types is None:  # the released configs alternate, sliding first
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)]
    return types


def _split_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The fused expert tensors as each expert's gate / up / down weights and biases ([out, in]
    `Linear` layout); the sinks as a module's weight."""
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 projection -> its blocks / scales so far
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        if leaf.endswith(("_blocks", "_scales")):
            parts = packed.setdefault(name[:-7], {})
            parts[leaf[-6:]] = tensor
            if len(parts) == 2:
                yield from _mxfp4_experts(name[:-7], parts["blocks"], parts["scales"])
        elif leaf == "sinks":
            yield f"{name}.weight", tensor
        elif leaf in ("gate_up_proj", "gate_up_proj_bias"):
            kind = "bias" if leaf.endswith("_bias") else "weight"
            for e, w in enumerate(tensor):
                w = w.T if kind == "weight" else w  # [hidden, 2 * inter] -> [2 * inter, hidden]
                yield f"{stem}.{e}.gate_proj.{kind}", w[0::2]
                yield f"{stem}.{e}.up_proj.{kind}", w[1::2]
        elif leaf in ("down_proj", "down_proj_bias") and stem.endswith(".experts"):
            kind = "bias" if leaf.endswith("_bias") else "weight"
            for e, w in enumerate(tensor):
                yield f"{stem}.{e}.down_proj.{kind}", w.T if kind == "weight" else w
        else:
            yield name, tensor


def _mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, QuantizedTensor]]:
    """OpenAI's MXFP4 layout -> GGUF MXFP4 blocks, per expert. Both hold 32 weights a block as an
    E8M0 exponent and 16 bytes of 4-bit codes with the same meaning; OpenAI packs weights 2b and
    2b + 1 into byte b (low nibble first), GGUF weights j and j + 16 into byte j."""
    stem, _, proj = name.rpartition(".")  # ...mlp.experts, gate_up_proj | down_proj
    n_exp, rows, groups, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(n_exp, rows, groups, 32)
    ggml = torch.cat((scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)
    ggml = ggml.reshape(n_exp, rows, groups * 17)
    k = groups * 32
    for e in range(n_exp):
        if proj == "gate_up_proj":  # gate and up rows interleaved
            for i, part in enumerate(("gate_proj", "up_proj")):
                yield (f"{stem}.{e}.{part}.weight",
                       QuantizedTensor(ggml[e, i::2].contiguous(), GGMLQuantizationType.MXFP4, (rows // 2, k)))
        else:
            yield f"{stem}.{e}.down_proj.weight", QuantizedTensor(ggml[e].contiguous(), GGMLQuantizationType.MXFP4, (rows, k))
