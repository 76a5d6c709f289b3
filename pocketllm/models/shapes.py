"""Named model shapes (Hugging Face config dicts) for random-weight benchmarks: no download needed.

`LLM(model="llama3-8b", load_format="dummy")` builds the runtime of that shape with random weights.
"""
from __future__ import annotations

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=dict(_LLAMA31_ROPE),
                      tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=dict(_LLAMA31_ROPE),
                       tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                         torch_dtype="bfloat16"),
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, attention_bias=True, sliding_window=128, swiglu_limit=7.0,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096,
                                         "rope_theta": 150000.0},
                        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, torch_dtype="bfloat16"),
    "llama3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        tie_word_embeddings=True, torch_dtype="bfloat16"),
}
