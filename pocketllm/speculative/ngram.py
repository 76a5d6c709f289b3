"""N-gram prompt lookup (vLLM's "ngram", llama.cpp's lookup decoding): the sequence's last n
tokens are searched for earlier in its prompt and output, and the tokens that followed their
latest earlier occurrence are proposed. The largest n in [min_n, max_n] that matches wins."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n and num_tokens >= 1
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow `token_ids` ([] when nothing matches)."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # windows starting at 0 .. n_tokens - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []
