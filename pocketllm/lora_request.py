"""A request's LoRA adapter, as vLLM names it: `LLM.generate(prompts, params, lora_request=LoRARequest(...))`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name; with `lora_path` (a PEFT directory) it is loaded under that name when the engine
    has none of it. `lora_int_id` is vLLM's id, accepted and unused: the engine tells loads apart itself."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None
