"""Qwen2: the Llama op sequence with biases on the Q, K and V projections."""
from pocketllm.config import ModelConfig
from pocketllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False

    @classmethod
    def attention_kinds(cls, cfg: ModelConfig) -> set[str]:
        # Qwen2's optional sliding window is off in every released checkpoint.
        return {"sliding_window"} if cfg.raw.get("use_sliding_window") else {"full"}
