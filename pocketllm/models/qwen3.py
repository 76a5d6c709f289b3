"""Qwen3: the Llama op sequence with RMSNorm on each head's queries and keys before rotary."""
from pocketllm.config import ModelConfig
from pocketllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @classmethod
    def attention_kinds(cls, cfg: ModelConfig) -> set[str]:
        return {"sliding_window"} if cfg.raw.get("use_sliding_window") else {"full"}
