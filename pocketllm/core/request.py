"""A request and all of its state: tokens, progress, KV blocks, timings."""
from __future__ import annotations

import time
from collections.abc import Sequence
from enum import IntEnum

import torch

from pocketllm.pooling_params import PoolingParams
from pocketllm.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence being generated. The scheduler moves `num_computed_tokens` toward
    `num_tokens`; when they meet after a step, the runner samples one more token."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None,
                 leader: Request | None = None, seed: int | None = None, cache_salt: str | None = None,
                 pooling: PoolingParams | None = None):
        """`prompt_token_ids` is shared, not copied: the siblings of an n > 1 request hold one copy
        of the prompt (and one `params`), and nobody changes either. `seed` (default params.seed)
        is this sequence's own; `cache_salt` keeps its prefix-cache blocks apart from other salts'."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # A sibling of an n > 1 request waits for its leader's prompt KV, then reuses it
        # through the prefix cache instead of computing it again.
        self.leader = leader
        self.cache_salt = cache_salt
        # An embedding request (its settings resolved): its prompt is pooled into `embedding` when its
        # last chunk is computed, and it finishes there; `pool_sum` carries mean pooling across chunks
        self.pooling = pooling
        self.pool_sum: torch.Tensor | None = None
        self.embedding: list[float] | None = None

        self._all_token_ids: list[int] | None = None  # prompt + output, made when first read
        self.output_token_ids: list[int] = []
        self.num_prompt_scored = 0  # prompt positions whose logprobs are recorded (params.prompt_logprobs)
        self.status = RequestStatus.WAITING
        # A LoRA adapter: its name, the identity of its load (its blocks are its own in the prefix cache),
        # and the slot of the layers' adapter stacks it runs in while it runs (-1: none)
        self.lora_name: str | None = None
        self.lora_id = 0
        self.lora_slot = -1
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is computed or being computed by a launched step
        self.num_pending = 0  # tokens sampled by launched steps that have not been appended yet
        self.num_cached_tokens = -1  # prefix-cache hit length at first admission; -1 = not admitted yet
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for its next step (speculative decoding)
        self.draft_hits = self.draft_misses = 0.0  # its recent drafts accepted, and steps that rejected one (decaying)
        self.draft_index = None  # the proposer's index of its tokens (speculative decoding)

        # One block table per KV group (kv_groups): logical block i of group g lives in
        # block_tables[g][i]; a sliding group's blocks behind its window are NO_BLOCK.
        self.block_tables: list[list[int]] = []
        self.num_released: list[int] = []  # per group: leading entries released (NO_BLOCK)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.num_hashed_blocks = 0  # leading logical blocks registered in the prefix cache

        seed = params.seed if seed is None else seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.sampling_state = None  # the sampler's tensors for this row (bias, penalties), made once
        self.structured = None  # a GrammarState when the output is constrained (structured_outputs)

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt and the output in one list, made when first read (a waiting sibling never
        copies the prompt)."""
        if self._all_token_ids is None:
            self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        return self._all_token_ids

    @all_token_ids.setter
    def all_token_ids(self, tokens: list[int]) -> None:  # a draft model's shadow sequence resets it
        self._all_token_ids = tokens

    @property
    def num_tokens(self) -> int:
        if self._all_token_ids is not None:
            return len(self._all_token_ids)
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table (the full-attention one, when the model has one)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request reads its previous tokens on the host (a grammar,
        penalties, a minimum length): its next step cannot be scheduled before the last
        one's token is back."""
        p = self.params
        return self.structured is not None or p.needs_penalties or p.min_tokens > 0 or self.pooling is not None

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hits): its prompt is scored,
        or pooled over more than its last token."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None and self.pooling.pooling != "last")

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self._all_token_ids is not None:
            self._all_token_ids.append(token_id)
        if self.structured is not None:  # once per sampled token: recomputing KV never comes here
            self.structured.accept(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_tables})")
