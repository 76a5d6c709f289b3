"""N-gram prompt lookup (vLLM's "ngram", llama.cpp's lookup decoding): the sequence's last n
tokens are searched for earlier in its prompt and output, and the tokens that followed their
latest earlier occurrence are proposed. The largest n in [min_n, max_n] that matches wins.

Each sequence keeps an index (its `NgramIndex`, on the request) from every n-gram to where the
tokens after its latest occurrence start, extended by the tokens added since the last lookup: a
lookup costs a few dictionary probes, whatever the sequence's length."""
from __future__ import annotations


class NgramIndex:
    __slots__ = ("tables", "indexed")

    def __init__(self, ns: range):
        self.tables = {n: {} for n in ns}  # n -> n-gram -> where its latest occurrence's continuation starts
        self.indexed = 0  # n-grams ending before this position are in the tables

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (each has a continuation)."""
        end = len(tokens) - 1
        for n, table in self.tables.items():
            lo = max(self.indexed, n)
            if lo <= end:  # n-gram tokens[e - n:e] -> e (its continuation), e = lo..end, the later ones last;
                # the tuples made by zip, in C (1.17x the loop's speed: results/cpu-ngram-index.json)
                table.update(zip(zip(*(tokens[lo - n + i:end - n + i + 1] for i in range(n))), range(lo, end + 1)))
        self.indexed = max(self.indexed, end + 1)


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n and num_tokens >= 1
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: list[int], limit: int | None = None, index: NgramIndex | None = None) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow `token_ids` ([] when nothing matches).
        `index` is the sequence's own (kept between calls as its tokens grow); without one, a
        fresh index is built."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        if k <= 0:
            return []
        if index is None:
            index = self.new_index()
        index.extend(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = index.tables[n].get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start:start + k]
        return []

    def propose_for(self, wanted: list) -> list[list[int]]:
        """Drafts for each (request, most drafts) pair, through the request's own index."""
        out = []
        for req, limit in wanted:
            if req.draft_index is None:
                req.draft_index = self.new_index()
            out.append(self.propose(req.all_token_ids, limit, req.draft_index))
        return out

    def new_index(self) -> NgramIndex:
        return NgramIndex(range(self.min_n, self.max_n + 1))
