"""Rotary scaling variants against transformers' own initialisation of the same configs."""
from __future__ import annotations

import pytest
import torch

from pocketllm.layers.rotary import RotaryEmbedding, attention_scaling, inv_frequencies

YARN = [
    dict(factor=4.0, original_max_position_embeddings=64),  # Qwen3's long-context form
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),  # gpt-oss
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=0.707),  # DeepSeek's mscale pair
    dict(factor=8.0, original_max_position_embeddings=1024, attention_factor=1.25),
]


@pytest.mark.parametrize("params", YARN)
def test_yarn_equals_transformers(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 64, 150000.0
    scaling = {"rope_type": "yarn", **params}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=4 * params["original_max_position_embeddings"],
                                   rope_parameters={"rope_theta": theta, **scaling})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.equal(inv_frequencies(head_dim, theta, scaling), inv_freq)
    assert attention_scaling(scaling) == factor
    rope = RotaryEmbedding(head_dim, 128, theta, scaling)
    positions = torch.arange(128, dtype=torch.float32)
    assert torch.allclose(rope.cos, torch.outer(positions, inv_freq).cos() * factor, atol=1e-6)
