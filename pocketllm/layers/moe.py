"""A mixture-of-experts MLP: a router scores every expert for each token, the top k experts run on
it, and their outputs are summed weighted by the router's probabilities.

The experts are ordinary gated MLPs (each its own `Linear` layers), so whatever a checkpoint holds
them in (safetensors, or one of the GGUF encodings on its CPU or GPU kernels) they multiply as a
dense model's MLP does, and a step touches only the experts its tokens selected.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pocketllm.layers.linear import Linear


class SparseMoE(torch.nn.Module):
    """``gate``: the router, a [num_experts, hidden] projection. Routing as transformers computes
    it: Qwen3-MoE and Mixtral take a softmax over all experts in float32, then the top k
    (torch.topk's order and ties), renormalised to sum to 1 when ``renormalize``; gpt-oss
    (``softmax_of_top_k``, a router bias) takes the top k logits, then a softmax over those."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert: Callable[[], torch.nn.Module], dtype, device, router_bias: bool = False,
                 softmax_of_top_k: bool = False):
        super().__init__()
        assert 0 < top_k <= num_experts, (top_k, num_experts)
        self.top_k, self.renormalize, self.softmax_of_top_k = top_k, renormalize, softmax_of_top_k
        self.gate = Linear(hidden_size, [num_experts], router_bias, dtype=dtype, device=device)
        self.experts = torch.nn.ModuleList(make_expert() for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int64 [T, k]) for the tokens x [T, hidden]."""
        if self.softmax_of_top_k:
            logits, ids = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), ids
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        # (token, slot) pairs grouped by expert: each selected expert runs once on its tokens
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens, w = order // self.top_k, weights.flatten()[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, expert(x[rows]).float() * w[start:start + n, None])
                start += n
        return out.to(x.dtype)
