"""How many drafts a request's next step carries.

Draft i (1-based) yields a token when it and every draft before it are accepted: with alpha the
request's recent chance that a draft is accepted given the one before was, that is alpha**i tokens.
It costs one more row in the step: b seconds, b the marginal time of a row, which plain decoding
would have spent on b * rate tokens (rate: the engine's tokens per second). A draft is proposed
while alpha**i > b * rate, with a margin. Both sides are measured as the engine runs: alpha per request (counts
that decay, so that a request which stops copying its prompt stops drafting), b by a least-squares
fit of decode steps' times against their rows. On this machine's CPU a row costs about a third of a
decode step of the default model, so a request drafts only while it keeps being right; a GPU at a
small batch pays almost nothing for a row. The rule is the optimum's condition: a step's tokens per
second grow with one more draft exactly when that draft's tokens per second exceed the step's.
"""
from __future__ import annotations

import math


class DraftLength:
    REQUEST_DECAY = 0.9  # per step of a request
    STEP_DECAY = 0.97  # per decode step of the engine
    MIN_STEPS = 6.0  # decayed count of decode steps before the fit is trusted
    MIN_ROW_SPREAD = 0.25  # variance of rows per step (rows^2) the fit needs
    MARGIN = 1.3  # a draft must pay for its row this many times over: the estimates are noisy, and a
    # marginal draft gains little when right and costs its row when wrong

    def __init__(self, max_drafts: int, prior_cost: float):
        self.max_drafts = max_drafts
        self.prior_cost = prior_cost  # tokens a row is worth until steps are measured
        self._n = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of (rows, seconds)
        self._tokens = self._seconds = 0.0  # decayed totals for the rate

    # -- the engine's steps ------------------------------------------------------------------
    def observe_step(self, rows: int, tokens: int, seconds: float) -> None:
        """A decode step of `rows` rows that gave `tokens` tokens in `seconds`."""
        d = self.STEP_DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds
        self._tokens = d * self._tokens + tokens
        self._seconds = d * self._seconds + seconds

    def cost(self) -> float:
        """What one more row costs, in tokens plain decoding would have made in its time."""
        if self._n < self.MIN_STEPS:
            return self.prior_cost
        mx, my = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mx * mx
        if var < self.MIN_ROW_SPREAD:
            return self.prior_cost
        per_row = min(max((self._xy / self._n - mx * my) / var, 0.0), my / mx)
        return per_row * self._tokens / self._seconds

    # -- a request's drafts ------------------------------------------------------------------
    @staticmethod
    def observe_request(req, num_drafts: int, num_accepted: int) -> None:
        d = DraftLength.REQUEST_DECAY
        req.draft_hits = d * req.draft_hits + num_accepted
        req.draft_misses = d * req.draft_misses + (num_accepted < num_drafts)

    def limit(self, req, cost: float) -> int:
        """Drafts worth proposing for the request's next step, a row costing `cost` (this step's
        `cost()`). A new request is taken to be right 4 times in 5; a request that stops drafting
        sees its misses decay with its steps, and tries again after a while (later each time it
        fails)."""
        alpha = (req.draft_hits + 1) / (req.draft_hits + req.draft_misses + 1.25)
        cost *= self.MARGIN
        if cost <= 0:
            return self.max_drafts
        if alpha <= cost:
            return 0
        return min(self.max_drafts, int(math.log(cost) / math.log(alpha)))
