"""Write a random-weight Hugging Face model of a named shape (for benchmarks; no download needed).

    python benchmarks/make_random_model.py smollm2-135m /tmp/llama135m
"""
from __future__ import annotations

import sys

import torch

SHAPES = {
    # SmolLM2-135M's shape: a ~135M-parameter Llama
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
}


def main(shape: str, out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape])
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main(*sys.argv[1:])
