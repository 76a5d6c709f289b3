"""The one scheduler, for every model runtime.

No prefill/decode phases: every request has `num_computed_tokens`, and each step spends one
token budget moving requests toward their token count — decode tokens of running requests
first, then prefill chunks of partially prefilled requests, then new admissions (FCFS), all
in one mixed batch. When KV blocks run out, the most recently admitted request is preempted
(its blocks freed, its tokens recomputed later), so the oldest request always progresses.

A request's progress advances when it is scheduled, not when the step's results come back:
with asynchronous scheduling the next step is scheduled while the last one still runs, and a
request whose sampled token is still in flight (`num_pending`) decodes that token next (the
runner takes it from the previous step's output on the device).

Speculative decoding: a decoding request with draft tokens (`Request.spec_token_ids`) computes
them with its last token in the same step, within the token budget and its KV slots; the tokens
its drafts did not match are taken back when the step's results come in (`num_computed_tokens`
rolls back, the blocks stay for the next step). Only full blocks of accepted tokens are ever
registered in the prefix cache, since drafts never join `all_token_ids` unverified.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pocketllm.core.request import Request, RequestStatus
from pocketllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pocketllm.engine.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # most prompt tokens in a step that also decodes (None: max_num_batched_tokens); chunked prefill only
    max_prefill_tokens_with_decodes: int | None = None
    watermark: float = 0.01  # share of blocks new admissions must leave free for running requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, lora=None):
        """`lora` (LoRA adapters, runner.lora_manager): `acquire(request)` gives an admitted request its
        adapter's slot or says no (it waits), `release(request)` gives it back when it stops running."""
        self.config = config
        self.kv = kv
        self.lora = lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.reserve_blocks = max(1, int(config.watermark * kv.num_blocks))
        self.num_preemptions = 0  # since the start, for metrics

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside the step (abort, stop string). Frees its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        req.sampling_state = None  # its sampler tensors (penalty counts: a vocabulary's worth)
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)

    def has_work(self) -> bool:
        return bool(self.requests)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        batch: dict[str, ScheduledRequest] = {}
        cap = self.config.max_prefill_tokens_with_decodes if self.config.enable_chunked_prefill else None
        prefilled = 0  # prompt tokens (of chunks, not decode rows) scheduled so far
        streams: bool | None = None  # whether a stream decodes in this step: known at the first chunk

        def prefill_room() -> int:
            """Prompt tokens this step may still take: fewer when a stream decodes in it (the cap). Every
            decode row is in `batch` by the first call: they come first in `order`, admissions last."""
            nonlocal streams
            if cap is None:
                return budget
            if streams is None:
                streams = any(s.is_decode and s.request.num_output_tokens + s.request.num_pending
                              for s in batch.values())
            return max(0, min(budget, cap - prefilled)) if streams else budget

        # Decode rows first, then running requests still in prefill.
        order = sorted(self.running, key=lambda r: r.num_tokens + r.num_pending - r.num_computed_tokens > 1)
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_pending and self._ends_with_pending(req):
                continue  # its token in flight is its last: nothing more to compute
            num_new = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            assert num_new > 0, f"running request with nothing to compute: {req}"
            if num_new > 1:  # a prefill chunk (decode rows come first in `order`)
                num_new = min(num_new, prefill_room())
                if num_new == 0:
                    continue
            drafts = self._drafts(req, budget - num_new) if num_new == 1 else []
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                batch[req.request_id] = ScheduledRequest(req, 1 + len(drafts), spec_token_ids=drafts)
                budget -= 1 + len(drafts)
                continue
            # without drafts (or room for them): a plain step, which may preempt
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim, out)
                dropped = batch.pop(victim.request_id, None)
                if dropped is not None:  # it was already in this step's batch: take it out
                    budget += dropped.num_tokens
                if victim is req:
                    break
            else:
                batch[req.request_id] = ScheduledRequest(req, num_new)
                budget -= num_new
                prefilled += num_new if num_new > 1 else 0

        # Admit waiting requests only when nobody was preempted this step: otherwise the
        # freed blocks belong to the running requests that needed them.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if req.num_pending:  # preempted with a token in flight: readmit once it is back
                break
            leader = req.leader
            if (leader is not None and self.kv.enable_prefix_caching and not leader.is_finished
                    and not leader.prefill_done):
                skipped.append(self.waiting.popleft())  # wait for the sibling's prompt KV
                continue
            hit = None if req.computes_whole_prompt else self.kv.find_cached_blocks(req)
            num_cached = hit.num_tokens if hit else 0
            num_new = req.num_tokens - num_cached
            room = prefill_room()
            if num_new > room:
                if not self.config.enable_chunked_prefill or room == 0:
                    break
                num_new = room
            reserve = self.reserve_blocks if self.running else 0
            if self.lora is not None and not self.lora.acquire(req):
                break  # every adapter slot runs another adapter's requests
            if not self.kv.allocate_slots(req, num_new, hit, reserve=reserve):
                if self.lora is not None:
                    self.lora.release(req)
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: count prefix hits once
                req.num_cached_tokens = num_cached
                self.kv.record_lookup(req.num_tokens, num_cached)
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch[req.request_id] = ScheduledRequest(req, num_new)
            budget -= num_new
            prefilled += num_new
        self.waiting.extendleft(reversed(skipped))

        # Decode rows first: the runner batches their attention.
        decodes = [s for s in batch.values() if s.is_decode]
        chunks = [s for s in batch.values() if not s.is_decode]
        out.scheduled = decodes + chunks
        out.num_decodes = len(decodes)
        assert budget >= 0 and len(self.running) <= self.config.max_num_seqs
        for sr in out.scheduled:
            req = sr.request
            sr.start = req.num_computed_tokens
            req.num_computed_tokens += sr.num_tokens
            num_spec = len(sr.spec_token_ids)
            sr.samples = req.num_computed_tokens - num_spec == req.num_tokens + req.num_pending
            # Only a decode row can start at a token still in flight (the runner reads it on the device).
            assert sr.start + sr.num_tokens - num_spec <= req.num_tokens or (sr.num_tokens == 1 and sr.start == req.num_tokens)
            assert not num_spec or (sr.samples and not req.num_pending), "drafts follow a token on the host"
            if sr.samples:
                req.num_pending += 1
            # Later steps run after this one (one stream), so its blocks may serve as prefix hits now.
            self.kv.cache_computed_blocks(req)
        return out

    def _drafts(self, req: Request, room: int) -> list[int]:
        """The request's drafts that this step can verify: within `room` more tokens of budget, and
        none past what its limits let it emit (each step emits the accepted drafts and one token)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or req.num_pending:
            return []
        p = req.params
        room = min(room, self.config.max_model_len - req.num_tokens)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _ends_with_pending(self, req: Request) -> bool:
        """Whether the tokens in flight already reach the request's length limit."""
        p = req.params
        if p.max_tokens is not None and req.num_output_tokens + req.num_pending >= p.max_tokens:
            return True
        return req.num_tokens + req.num_pending >= self.config.max_model_len

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # -- after the forward --------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Append the step's sampled tokens (for a request with drafts: the accepted drafts and one
        more; the KV of the rejected ones is rolled back) and finish what must stop. `on_token`
        (request, index in its new tokens) follows each token and may finish the request too (a
        stop string); a finished request takes no more tokens. A request preempted since the step
        was launched still gets its token (it is recomputed with the rest); one that finished
        meanwhile (abort, stop string, an earlier stop) does not.
        Returns the requests that received tokens this step."""
        touched = []
        for sr in out.scheduled:
            req = sr.request
            if not sr.samples or req.is_finished:
                continue
            req.num_pending -= 1
            if req.pooling is not None:  # its prompt is pooled: nothing follows
                self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                touched.append(req)
                continue
            tokens = sampled[req.request_id]
            assert 1 <= len(tokens) <= 1 + len(sr.spec_token_ids), (req, tokens)
            if sr.spec_token_ids and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= 1 + len(sr.spec_token_ids) - len(tokens)
            touched.append(req)
            for i, token in enumerate(tokens):
                req.append_output_token(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish_request(req.request_id, status)
                if on_token is not None:
                    on_token(req, i)
                if req.is_finished:
                    break
        return touched

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.structured is not None and req.structured.is_terminated:  # the grammar took a stop token
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_set:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
