"""One step's batch as the scheduler hands it to the model runner: the typed boundary between them."""
from __future__ import annotations

from dataclasses import dataclass, field

from pocketllm.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step
    start: int = 0  # position of the first of them (set when the batch is final)
    samples: bool = False  # the step reaches the end of the request's tokens: a token is sampled
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens computed after the last token

    @property
    def is_decode(self) -> bool:
        """One query token, or a last token and its drafts (the runner makes a decode row of each)."""
        return self.num_tokens == 1 + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    """One step's batch: decode requests first (`is_decode`), then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0  # requests in decode; with drafts they make more decode rows
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
