"""Embedding requests' vectors from the step's final hidden states: the last token's, the first's, or the
mean over the prompt (summed across its chunks on the request), cut to `dimensions`, then normalized."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, entries: list[tuple]) -> list[tuple[str, torch.Tensor]]:
    """(request id, vector on the device) for each entry (StepInputs.pooling) whose prompt ends this step."""
    out = []
    for req, row, n, start, final in entries:
        p = req.pooling
        if p.pooling == "mean":
            part = hidden[row:row + n].float().sum(0)
            req.pool_sum = part if start == 0 else req.pool_sum + part  # a recomputation starts over
            vector = req.pool_sum / req.num_prompt_tokens if final else None
        elif p.pooling == "cls":
            if start == 0:
                req.pool_sum = hidden[row].float()
            vector = req.pool_sum if final else None
        else:
            vector = hidden[row + n - 1].float() if final else None
        if vector is None:
            continue
        if p.dimensions is not None:
            vector = vector[:p.dimensions]
        if p.normalize:
            vector = F.normalize(vector, dim=0)
        out.append((req.request_id, vector))
    return out
