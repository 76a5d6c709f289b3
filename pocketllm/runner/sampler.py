"""Batched sampling with per-row parameters. Rows that need nothing special pay nothing:
each processing stage runs only on the rows that asked for it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pocketllm.engine.request import Request
from pocketllm.structured.backend import apply_grammar_masks


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # top-k (token, logprob), best first


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        # Sampling runs on the host for now: per-row parameters, generators and grammar masks
        # live there. (A sync-free GPU sampler belongs to the CUDA fast path.)
        logits = logits.float().cpu()
        raw = logits
        logits = logits.clone()
        vocab = logits.shape[1]
        self._apply_bias_and_bans(logits, reqs, vocab)
        constrained = [i for i, r in enumerate(reqs) if r.structured is not None]
        if constrained:
            apply_grammar_masks(logits, constrained, [reqs[i].structured for i in constrained])
        pen = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if pen:
            logits[pen] = apply_penalties(logits[pen], [reqs[i] for i in pen], vocab)

        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[i] for i in rand])

        tokens_list = tokens.tolist()
        out = [SampledToken(t) for t in tokens_list]
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            logprobs = torch.log_softmax(raw[lp_rows], dim=-1)
            k = max(reqs[i].params.logprobs for i in lp_rows)
            top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
            chosen = tokens[lp_rows]
            chosen_lp = logprobs.gather(1, chosen[:, None])
            ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
            for j, i in enumerate(lp_rows):
                n = reqs[i].params.logprobs
                out[i].logprob = chosen_lp[j, 0].item()
                out[i].rank = int(ranks[j])
                out[i].top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
        return out

    @staticmethod
    def _apply_bias_and_bans(logits: torch.Tensor, reqs: list[Request], vocab: int) -> None:
        for i, r in enumerate(reqs):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([v for t, v in p.logit_bias.items() if 0 <= t < vocab])
                logits[i].index_add_(0, ids, vals)
            if r.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos and r.structured is None:  # a grammar decides when EOS may come
                    banned |= r.eos_token_ids
                if banned:
                    logits[i, [t for t in banned if t < vocab]] = float("-inf")

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temp = torch.tensor([r.params.temperature for r in reqs])
        logits = logits / temp[:, None]
        top_k = [r.params.top_k for r in reqs]
        if any(top_k):
            k = torch.tensor([kk if kk > 0 else logits.shape[1] for kk in top_k])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.tensor([r.params.top_p for r in reqs])
        if (top_p < 1).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
            probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
        min_p = torch.tensor([r.params.min_p for r in reqs])
        if (min_p > 0).any():
            cut = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < cut, 0.0)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with no host sync;
        # seeded rows draw their noise from their own generator, so the batch cannot change it.
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, reqs: list[Request], vocab: int) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (as vLLM and transformers apply it);
    presence and frequency penalties over output tokens (as OpenAI defines them)."""
    n = len(reqs)
    out_counts = torch.zeros(n, vocab + 1)
    outs = _padded([r.output_token_ids for r in reqs], vocab)
    out_counts.scatter_add_(1, outs, torch.ones_like(outs, dtype=torch.float32))
    out_counts = out_counts[:, :vocab]
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool)
    seen.scatter_(1, _padded([r.prompt_token_ids for r in reqs], vocab), True)
    seen = seen[:, :vocab] | (out_counts > 0)

    rep = torch.tensor([r.params.repetition_penalty for r in reqs])[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in reqs])[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in reqs])[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
