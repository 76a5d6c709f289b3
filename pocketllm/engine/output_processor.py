"""Per-request output state: detokenized text, logprobs, and RequestOutput assembly.
A request with n > 1 is a parent whose n children are scheduled as separate sequences."""
from __future__ import annotations

from dataclasses import dataclass, field

from pocketllm.core.request import Request
from pocketllm.engine.detokenizer import IncrementalDetokenizer, StopStrings
from pocketllm.outputs import CompletionOutput, Logprob, RequestOutput
from pocketllm.runner.sampler import SampledToken


@dataclass
class ChildState:
    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    stop_reason: str | int | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob]] | None = None  # the first child's, when asked for
    error: str | None = None  # set when the engine failed the request

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        outs = []
        for c in self.children:
            r = c.request
            done = r.is_finished
            outs.append(CompletionOutput(
                index=c.index,
                text=c.detok.visible_text(done) if c.detok else "",
                token_ids=list(r.output_token_ids),
                logprobs=c.logprobs,
                finish_reason=r.status.finish_reason if done else None,
                stop_reason=c.stop_reason if c.stop_reason is not None else r.stop_reason,
            ))
        first = self.children[0].request
        reqs = [c.request for c in self.children]
        # The request's times over its choices: its first sequence scheduled and first token, its
        # last sequence finished (None until all are).
        scheduled = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        first_tokens = [r.first_token_time for r in reqs if r.first_token_time is not None]
        finished = [r.finished_time for r in reqs if r.finished_time is not None]
        metrics = {"arrival_time": first.arrival_time, "first_scheduled_time": min(scheduled, default=None),
                   "first_token_time": min(first_tokens, default=None),
                   "finished_time": max(finished) if self.finished and finished else None,
                   "num_preemptions": sum(r.num_preemptions for r in reqs)}
        prompt_lps = None if self.prompt_logprobs is None else [None, *self.prompt_logprobs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             finished=self.finished, num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics=metrics, prompt_logprobs=prompt_lps, error=self.error,
                             embedding=first.embedding)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_of: dict[str, ChildState] = {}
        self.parent_of: dict[str, ParentState] = {}

    def add(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for c in parent.children:
            self.child_of[c.request.request_id] = c
            self.parent_of[c.request.request_id] = parent

    def make_child(self, index: int, req: Request, stop: StopStrings | None) -> ChildState:
        """`stop`: the request's stop strings, indexed once for all its children."""
        p = req.params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, stop,
                                           p.include_stop_str_in_output, p.skip_special_tokens)
        return ChildState(index, req, detok, [] if p.logprobs is not None else None)

    def process(self, req: Request, tok: SampledToken) -> str | None:
        """Record a sampled token; returns a stop string if the text now contains one."""
        child = self.child_of[req.request_id]
        if child.logprobs is not None:
            child.logprobs.append(self._entry(tok))
        if child.detok is None or self._ended_by_stop_token(req):
            return None
        hit = child.detok.add(tok.token_id)
        if hit is not None:
            child.stop_reason = hit
        return hit

    @staticmethod
    def _ended_by_stop_token(req: Request) -> bool:
        """EOS and stop_token_ids end the text without appearing in it (unless asked to)."""
        return (req.status.finish_reason == "stop" and not req.params.include_stop_str_in_output
                and not isinstance(req.stop_reason, str))

    def add_prompt_logprobs(self, req: Request, scored: list[SampledToken]) -> None:
        parent = self.parent_of[req.request_id]
        if parent.children[0].request is req:  # siblings score the same prompt: one copy
            parent.prompt_logprobs.extend(self._entry(t) for t in scored)

    def _entry(self, tok: SampledToken) -> dict[int, Logprob]:
        """A token's logprob entry: the token first, then the top ones (rank order)."""
        entry = {tok.token_id: Logprob(tok.logprob, tok.rank, self._piece(tok.token_id))}
        for rank, (tid, lp) in enumerate(tok.top or [], start=1):
            entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
        return entry

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def pop_finished(self, request_id: str) -> ParentState | None:
        parent = self.parents.get(request_id)
        if parent is None or not parent.finished:
            return None
        del self.parents[request_id]
        for c in parent.children:
            self.child_of.pop(c.request.request_id, None)
            self.parent_of.pop(c.request.request_id, None)
        return parent
