"""A step's inputs flattened on the host by the model runner (and broadcast to tensor-parallel ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    """The step flattened on the host: one row of `rows` per scheduled request, decodes first."""

    input_ids: list[int]
    positions: list[int]
    slots: list[list[int]]  # per KV group: each token's cache slot
    rows: list[tuple[int, int]]  # (query_len, context_len)
    tables: list[list[list[int]]]  # per KV group, per row: block ids covering the context (NO_BLOCK behind a window)
    num_decodes: int  # decode rows (query length 1), a request with drafts making several
    logits_rows: list[int]  # token rows whose logits are sampled
    sampling: list  # their requests, a DraftPosition for each draft's row
    # decode rows whose input token is still in flight: (token row, row in the previous step's sample)
    pending: list[tuple[int, int]] = field(default_factory=list)
    # prompt logprobs to score: (request, its first scored position, that position's token row,
    # the next prompt token of each scored position)
    prompt_scores: list[tuple] = field(default_factory=list)
    # per decode row, its index among its request's rows (0, 1, .. for a token and its drafts): the
    # attention kernel reads a run's keys once (empty: every request has one row, or TP ranks' copies)
    chain_pos: list[int] = field(default_factory=list)
    # embedding requests' rows: (request, its first token row, its rows this step, its first position,
    # whether its prompt ends in this step)
    pooling: list[tuple] = field(default_factory=list)
