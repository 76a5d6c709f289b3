"""Speculative decoding around the engine's steps: drafts proposed for the requests a step touched
(n-gram lookup or a draft model), as many as are worth their rows (`DraftLength`), looked for only
when steps find some (under asynchronous scheduling a step that drafts gives up the overlap), and
vLLM's spec_decode_* counters. The scheduler verifies the drafts within its token budget."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pocketllm.core.request import Request, RequestStatus
from pocketllm.core.scheduler_output import SchedulerOutput
from pocketllm.speculative.draft_length import DraftLength


@dataclass
class SpecDecodingStats:
    """Cumulative counts of speculative decoding, vLLM's spec_decode_* metrics."""

    num_drafts: int = 0  # steps of a request that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    # Overlapped steps, at most, before drafts are looked for again after steps that found none.
    MAX_DRAFT_PAUSE = 32

    def __init__(self, proposer, num_speculative_tokens: int, cpu: bool, overlapped: bool):
        """`proposer.propose_for([(request, at most n)]) -> drafts per request`, and where it has one,
        `proposer.observe(step, its hidden states, its tokens)` after every step; `overlapped`: the
        engine schedules each step while the one before runs (asynchronous scheduling)."""
        self.proposer = proposer
        self._observe = getattr(proposer, "observe", None)
        # until steps are measured: a row's share of a decode step at batch 1 (docs/performance/speculative-decoding.md)
        self.draft_length = DraftLength(num_speculative_tokens, 0.3 if cpu else 0.05)
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * num_speculative_tokens)
        self.overlapped = overlapped
        self._pause = self._backoff = 0  # overlapped steps before drafts are looked for again
        self._last_done: float | None = None  # when the last step's results were read back

    def wants_drafts(self) -> bool:
        """Whether this step looks for drafts (it then reads the step before back first); asked once a step."""
        if self._pause:
            self._pause -= 1
            return False
        return True

    def propose(self, reqs: list[Request]) -> None:
        """Drafts for the requests' next step, as many as are worth their rows; under a grammar, only
        those it accepts. Steps that find none give up the overlap for nothing: after such a step the
        next ones run overlapped (1, 2, 4, ... 32 of them) before drafts are looked for again."""
        cost = self.draft_length.cost()
        wanted = [(r, n) for r in reqs if r.status == RequestStatus.RUNNING and (n := self.draft_length.limit(r, cost))]
        found = False
        for (req, _), drafts in zip(wanted, self.proposer.propose_for(wanted)):
            if drafts and req.structured is not None:
                drafts = drafts[:req.structured.valid_prefix(drafts)]
            req.spec_token_ids = drafts
            found |= bool(drafts)
        if self.overlapped:
            self._backoff = 0 if found else min(2 * self._backoff or 1, self.MAX_DRAFT_PAUSE)
            self._pause = self._backoff

    def step_done(self, sched: SchedulerOutput, sampled: dict[str, list], more_work: bool, hidden=None) -> None:
        """The counters, each request's acceptance, and the step's cost per row, once a step's tokens
        (`sampled`: request id -> its tokens; `hidden`: its rows' final hidden states) are back."""
        if self._observe is not None:
            self._observe(sched, hidden, sampled)
        stats, emitted = self.stats, 0
        for sr in sched.scheduled:
            toks = sampled.get(sr.request.request_id)
            if not toks:
                continue
            emitted += len(toks)
            accepted, drafts = len(toks) - 1, len(sr.spec_token_ids)
            self.draft_length.observe_request(sr.request, drafts, accepted)
            if drafts:
                stats.num_drafts += 1
                stats.num_draft_tokens += drafts
                stats.num_accepted_tokens += accepted
                for i in range(accepted):
                    stats.accepted_per_pos[i] += 1
        # The time between two steps' results is a step's time, whether or not steps overlap.
        now = time.perf_counter()
        if self._last_done is not None and sched.num_decodes == len(sched.scheduled):
            self.draft_length.observe_step(sched.total_tokens, emitted, now - self._last_done)
        self._last_done = now if more_work else None
