"""What the engine returns, shaped as vLLM's RequestOutput so users can switch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one entry each
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the engine failed this request (a bug it isolated); the request is finished, aborted.
    error: str | None = None
    embedding: list[float] | None = None  # an embedding request's vector, once finished (task embed)
