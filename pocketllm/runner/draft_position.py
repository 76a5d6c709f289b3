"""A request as the sampler sees it at a draft position of a speculative step."""
from __future__ import annotations

from pocketllm.core.request import Request


class DraftGrammar:
    """The request's grammar after the first drafts: its mask is filled with the matcher walked
    through them and back (the drafts were checked against the grammar when proposed)."""

    __slots__ = ("state", "drafts")

    def __init__(self, state, drafts: list[int]):
        self.state, self.drafts = state, drafts

    def fill_bitmask(self, bitmask, row: int) -> bool:
        matcher = self.state.matcher
        for t in self.drafts:
            accepted = matcher.accept_token(t)
            assert accepted, "a draft token the grammar rejects was not cut when proposed"
        try:
            return matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            matcher.rollback(len(self.drafts))


class DraftPosition:
    """`request` at position `index` (>= 1) of its speculative step, whose input is draft token
    `drafts[index - 1]`: its output as if the drafts up to there were accepted, so that
    penalties, min_tokens and the grammar see the same sequence a plain decode step would."""

    __slots__ = ("request", "index", "token", "output_token_ids", "structured")

    def __init__(self, request: Request, drafts: list[int], index: int):
        self.request, self.index, self.token = request, index, drafts[index - 1]
        self.output_token_ids = request.output_token_ids + drafts[:index]
        self.structured = None if request.structured is None else DraftGrammar(request.structured, drafts[:index])

    def __getattr__(self, name: str):  # params, generator, eos_token_ids, prompt_token_ids, request_id
        return getattr(self.request, name)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
