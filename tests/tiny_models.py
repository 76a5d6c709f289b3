"""Tiny random-weight models made with transformers and saved as safetensors: the reference
for every parity test. Seeded, so every run builds the same weights."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384

CONFIGS = {
    # GQA 4:2, untied, llama3 rope scaling
    "llama": dict(arch="LlamaForCausalLM", hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # GQA 6:1 (any ratio), tied embeddings, qkv bias
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True),
    # head_dim 32 != hidden / heads, q/k norm, MHA-free GQA 4:2
    "qwen3": dict(arch="Qwen3ForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # sliding window 8 on layers 0, 1 and 3, global layer 2; Gemma's norms, GeGLU, scaled embedding
    "gemma3": dict(arch="Gemma3ForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                   sliding_window=8, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    # mixture of experts: top 2 of 6 renormalised, q/k norm, a dense MLP on layer 1 (mlp_only_layers);
    # YaRN rope scaling (prompts and generations run past its original 64 positions)
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                      tie_word_embeddings=False,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # mixture of experts in every layer: top 2 of 4, always renormalised; checkpoint names w1/w2/w3
    "mixtral": dict(arch="MixtralForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
    # sinks, window 8 on layers 0 and 2, YaRN, biased router and experts, softmax over the top 2 of 4
    # logits; a SwiGLU limit low enough that the clamps act
    "gpt_oss": dict(arch="GptOssForCausalLM", hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.3, tie_word_embeddings=False,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # multi-head latent attention (V2-Lite's: no query bottleneck), shared + routed experts from layer 1,
    # a softmax over 8 experts, top 2 within the best 1 of 2 groups, scaled, not renormalised
    "deepseek_v2": dict(arch="DeepseekV2ForCausalLM", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                        tie_word_embeddings=False),
    # V3's: a query bottleneck, sigmoid scores with a correction bias choosing the top 2 within the best
    # 2 of 4 groups, renormalised and scaled; YaRN with DeepSeek's mscale pair (equal, as released configs
    # and GGUF files have them: the softmax scale takes mscale^2)
    "deepseek_v3": dict(arch="DeepseekV3ForCausalLM", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        tie_word_embeddings=False,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 0.7, "mscale_all_dim": 0.7}),
}


def make_model(kind: str, root: Path, **overrides):
    import transformers

    spec = {**CONFIGS[kind], **overrides}
    arch = spec.pop("arch")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config").replace("Gemma3", "Gemma3Text"))
    rope = spec.pop("rope_scaling", None)
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **spec)
    if rope is not None:
        config.rope_parameters = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(1234)
    model = getattr(transformers, arch)(config).eval()
    if kind == "gpt_oss":  # a reference that ignores the limit differs from every engine that reads it
        assert model.model.layers[0].mlp.experts.limit == spec["swiglu_limit"], \
            f"transformers {transformers.__version__} ignores gpt-oss's swiglu_limit: the tests need >= 5.19"
    with torch.no_grad():  # default init is tiny; scale up so logits are not all near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (experts' weights are [experts, out, in])
                p.normal_(0.0, 0.08)
            elif "norm" in name:  # random norm weights exercise each norm's exact form
                p.normal_(1.0 if kind != "gemma3" else 0.0, 0.1)
            elif kind == "gpt_oss":  # biases and sinks (zeros or uninitialised otherwise)
                p.normal_(0.0, 0.5 if name.endswith("sinks") else 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (zeros otherwise: it would choose nothing)
                b.normal_(0.0, 0.1)
    path = root / kind
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.eos_token_id = None
    return model, path


def make_llama256(root: Path, num_layers: int = 2):
    """A llama whose rows are 256 wide, so that the K-quant mixes really use Q4_K / Q6_K (blocks of
    256), with `num_layers` layers and no tokenizer: (transformers model, safetensors directory)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    path = root / "llama256"
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def make_tiny_chat_model(root: Path, vocab: Path | None = None) -> Path:
    """A one-layer llama, 32 wide, with the default model's tokenizer and chat template (or those of
    the GGUF `vocab`): a real tokenizer and template at a few milliseconds a step (random weights: it
    talks nonsense, and rarely ends on its own). For server tests that need text but not a good model."""
    import json

    import transformers
    from fixtures import default_model_gguf

    from pocketllm.tokenizer.gguf_vocab import load_gguf_tokenizer

    tok = load_gguf_tokenizer(vocab or default_model_gguf())
    path = root / "tiny-chat"
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=4096, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    tok._backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**tok.special_tokens, "chat_template": tok.chat_template}))
    return path
