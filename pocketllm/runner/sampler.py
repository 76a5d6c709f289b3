"""Batched sampling with per-row parameters. Rows that need nothing special pay nothing:
each processing stage runs only on the rows that asked for it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pocketllm.core.request import Request
from pocketllm.structured.backend import apply_grammar_masks


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # top-k (token, logprob), best first


@dataclass
class DeviceSample:
    """A step's sampled tokens, on their way to the host. On CUDA the copy into pinned memory is
    queued right behind the sampling, so that reading it waits for this step only, not for a
    step launched after it (`tolist()` on the device tensor would queue behind that one)."""

    tokens: torch.Tensor  # [rows] long
    logprob_rows: list[int]  # rows that asked for logprobs, and how many top entries each
    logprob_counts: list[int]
    logprobs: tuple[torch.Tensor, ...] = ()  # chosen logprob, rank, top values, top ids
    failed: dict[int, Exception] = field(default_factory=dict)  # rows that could not be sampled
    _copied: object = None  # the CUDA event after the copies

    def start_copy(self) -> DeviceSample:
        if self.tokens.is_cuda:
            def pinned(t: torch.Tensor) -> torch.Tensor:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return host.copy_(t, non_blocking=True)

            self.tokens = pinned(self.tokens)
            self.logprobs = tuple(pinned(t) for t in self.logprobs)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self

    def to_host(self) -> list[SampledToken]:
        if self._copied is not None:
            self._copied.synchronize()
        out = [SampledToken(t) for t in self.tokens.tolist()]
        if self.logprob_rows:
            chosen, ranks, top_vals, top_ids = (t.tolist() for t in self.logprobs)
            for j, (i, n) in enumerate(zip(self.logprob_rows, self.logprob_counts)):
                out[i].logprob, out[i].rank = chosen[j], ranks[j]
                out[i].top = list(zip(top_ids[j][:n], top_vals[j][:n]))
        return out


class Sampler:
    """Samples on the logits' device without a host synchronisation; `DeviceSample.to_host`
    reads the chosen tokens (and, for rows that ask, their logprobs) back."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        return self.sample(logits, reqs).to_host()

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> DeviceSample:
        raw = logits = logits.float()
        vocab = logits.shape[1]
        constrained = [i for i, r in enumerate(reqs) if r.structured is not None]
        pen = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if constrained or pen or any(r.params.logit_bias or r.num_output_tokens < r.params.min_tokens
                                     for r in reqs):
            logits = logits.clone()  # `raw` stays intact for logprobs
            self._apply_bias_and_bans(logits, reqs, vocab)
            if constrained:
                apply_grammar_masks(logits, constrained, [reqs[i].structured for i in constrained])
            if pen:
                logits[pen] = apply_penalties(logits[pen], [reqs[i] for i in pen], vocab)

        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[i] for i in rand])

        return _with_logprobs(tokens, raw, reqs)

    def sample_each(self, logits: torch.Tensor, reqs: list[Request]) -> DeviceSample:
        """After the batch failed to sample: every row alone, so that a request whose parameters
        break sampling fails by itself (`DeviceSample.failed`) and the others get their tokens."""
        tokens = torch.zeros(len(reqs), dtype=torch.long, device=logits.device)
        failed: dict[int, Exception] = {}
        for i, req in enumerate(reqs):
            try:
                tokens[i] = self.sample(logits[i:i + 1], [req]).tokens[0]
            except Exception as e:  # noqa: BLE001  (reported with the row)
                failed[i] = e
        return _with_logprobs(tokens, logits.float(), reqs, failed)

    @staticmethod
    def _apply_bias_and_bans(logits: torch.Tensor, reqs: list[Request], vocab: int) -> None:
        for i, r in enumerate(reqs):
            state = RowState.of(r, vocab, logits.device)
            if state.bias_ids is not None:
                logits[i].index_add_(0, state.bias_ids, state.bias_values)
            if state.banned is not None and r.num_output_tokens < r.params.min_tokens:
                logits[i].index_fill_(0, state.banned, float("-inf"))

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """`logits`: the rows' own copy (changed in place: a vocabulary's floats a row, 64 rows a step)."""
        dev = logits.device
        logits = logits.div_(_column([r.params.temperature for r in reqs], dev))
        top_k = [r.params.top_k for r in reqs]
        if any(top_k):
            vocab = logits.shape[1]  # k beyond the vocabulary keeps every token, as k = 0 does
            k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=dev)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        del logits
        if any(r.params.top_p < 1 for r in reqs):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > _column([r.params.top_p for r in reqs], dev)
            probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
        if any(r.params.min_p > 0 for r in reqs):
            cut = probs.max(dim=-1, keepdim=True).values * _column([r.params.min_p for r in reqs], dev)
            probs = probs.masked_fill(probs < cut, 0.0)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with no host sync;
        # seeded rows draw their noise on the host from their own generator, so neither the
        # batch nor the device can change what they sample.
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if len(unseeded) == len(reqs):  # in place: no second vocabulary-wide buffer
            _exponential(noise, self.generator)
        elif unseeded:
            noise[unseeded] = _exponential(torch.empty(len(unseeded), probs.shape[1], device=dev), self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i] = _exponential(torch.empty(probs.shape[1]), r.generator).to(dev, non_blocking=True)
        return probs.div_(noise).argmax(dim=-1)


def _exponential(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`t` filled with Exp(1) draws, -log u for uniforms u, never 0 (a 0 would let a token of any
    probability win). torch's exponential_ took 63 ms of a 64-row step of the default model on 2 cores,
    this 11 ms (benchmarks/results/cpu-hostile-traffic.md)."""
    return t.uniform_(generator=generator).clamp_(min=torch.finfo(t.dtype).tiny).log_().neg_()


def _with_logprobs(tokens: torch.Tensor, raw: torch.Tensor, reqs: list[Request],
                   failed: dict[int, Exception] | None = None) -> DeviceSample:
    """The sampled tokens, with the logprobs of the rows that ask for them (failed rows do not)."""
    failed = failed or {}
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None and i not in failed]
    if not rows:
        return DeviceSample(tokens, [], [], failed=failed)
    counts = [reqs[i].params.logprobs for i in rows]
    return DeviceSample(tokens, rows, counts, token_logprobs(raw[rows], tokens[rows], max(counts)), failed=failed)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """From float logits [rows, vocab]: each row's token's logprob and rank, and the row's top
    max(k, 1) logprobs (values, ids): DeviceSample.logprobs."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return chosen, (logprobs > chosen[:, None]).sum(dim=-1) + 1, top_vals, top_ids


def apply_penalties(logits: torch.Tensor, reqs: list[Request], vocab: int) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (as vLLM and transformers apply it);
    presence and frequency penalties over output tokens (as OpenAI defines them). Each request's
    counts are kept between steps (`RowState`): a step adds its new tokens, not the whole output."""
    dev = logits.device
    states = [RowState.of(r, vocab, dev).penalties_caught_up(r) for r in reqs]
    counts = torch.stack([st.counts for st in states])
    for i, (r, st) in enumerate(zip(reqs, states)):
        drafts = r.output_token_ids[st.num_counted:]  # a draft position's drafts: counted in this step only
        if drafts:
            counts[i].index_add_(0, torch.tensor(drafts, device=dev), torch.ones(len(drafts), device=dev))
    seen = torch.stack([st.prompt_seen for st in states]) | (counts > 0)
    rep = _column([r.params.repetition_penalty for r in reqs], dev)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = _column([r.params.frequency_penalty for r in reqs], dev)
    pres = _column([r.params.presence_penalty for r in reqs], dev)
    return logits - freq * counts - pres * (counts > 0).float()


@dataclass
class RowState:
    """A request's sampling tensors on the logits' device, built once rather than every step
    (`Request.sampling_state`; dropped when the request finishes): its logit bias, the tokens it
    bans before min_tokens, and its penalties' prompt tokens and output token counts."""

    device: torch.device
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None  # bool [vocab]
    counts: torch.Tensor | None = None  # float [vocab]: the first num_counted output tokens
    num_counted: int = 0

    @classmethod
    def of(cls, req: Request, vocab: int, device: torch.device) -> RowState:
        state = req.sampling_state
        if state is None or state.device != device:
            state = cls._build(req, vocab, device)
            _owner(req).sampling_state = state
        return state

    @classmethod
    def _build(cls, req: Request, vocab: int, device: torch.device) -> RowState:
        p = req.params
        state = cls(device)
        if p.logit_bias:
            state.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
            state.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)
        if p.min_tokens > 0:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos and req.structured is None:  # a grammar decides when EOS may come
                banned |= req.eos_token_ids
            banned = sorted(t for t in banned if t < vocab)
            if banned:
                state.banned = torch.tensor(banned, dtype=torch.long, device=device)
        if p.needs_penalties:
            state.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            state.prompt_seen[torch.tensor(list(req.prompt_token_ids), dtype=torch.long, device=device)] = True
            state.counts = torch.zeros(vocab, device=device)
        return state

    def penalties_caught_up(self, req: Request) -> RowState:
        """The counts with the request's output tokens added since the last step."""
        outputs = _owner(req).output_token_ids
        if len(outputs) > self.num_counted:
            new = torch.tensor(outputs[self.num_counted:], dtype=torch.long, device=self.device)
            self.counts.index_add_(0, new, torch.ones(len(new), device=self.device))
            self.num_counted = len(outputs)
        return self


def _owner(req) -> Request:
    """The request itself: a DraftPosition stands for its request at a draft position."""
    return getattr(req, "request", req)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device)[:, None]
