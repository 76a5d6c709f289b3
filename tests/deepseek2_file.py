"""Small DeepSeek GGUF files (llama.cpp's `deepseek2` architecture) of seeded random F32 weights, written by
our dummy-GGUF writer from numpy's generator: the same bytes on every machine, so that the tokens llama.cpp
generated from them (tests/data/deepseek2_llamacpp.json, recorded by benchmarks/tools/record_deepseek2.sh)
are a reference for PocketLLM's reading of the format, beside transformers' for the runtime itself."""
from __future__ import annotations

from pathlib import Path

from pocketllm.core.shapes import SHAPES

# V3's routing (sigmoid scores, groups by their two best) and query bottleneck; V2's softmax routing without
# groups (llama.cpp ranks groups as V3 does, transformers' V2 by their best expert), with V2's query bottleneck
# (llama.cpp reads a file without one as V2-Lite only at V2-Lite's 27 layers)
SMALL = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, vocab_size=300, n_routed_experts=8, num_experts_per_tok=2,
             first_k_dense_replace=1, max_position_embeddings=4096)
FILES = {"v3": {**SHAPES["deepseek-v3"], **SMALL, "n_group": 4, "topk_group": 2},
         "v2": {**SHAPES["deepseek-v2-lite"], **SMALL, "n_shared_experts": 1}}
PROMPTS = ["Hello my name is", "The capital of France"]
NEW_TOKENS = 12


def write_deepseek2(out: Path, which: str) -> Path:
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf

    return write_dummy_gguf(out, FILES[which], "F32", seed=5, std=0.08).path
