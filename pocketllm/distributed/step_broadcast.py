"""How rank 0 tells the other tensor-parallel ranks what to run: each step as two broadcasts of
int64 tensors (a 2-entry header, then the step's flattened positions, slots, block tables, the
rows whose logits are computed and, with LoRA adapters, each row's adapter slot and the adapters
put into slots since the last step) plus one of the input ids as rank 0 built them on its device
(with the tokens still in flight from the step before filled in). No Python objects are pickled."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pocketllm.core.step import StepInputs

STEP, STOP = 1, 2


def encode(step: StepInputs, score_rows: list[int], lora_slots: list[int] | None = None,
           fills: list[tuple[int, int, str]] = ()) -> list[int]:
    """The step as ints: counts, then positions, (query_len, context_len) per row, per KV group
    the slots and the block tables (lengths, then entries), the logits rows, the prompt rows
    scored (``score_rows``), each row's LoRA slot and the adapters filled: (slot, identity, path)."""
    n_groups = len(step.slots)
    fill_ints = [v for slot, ident, path in fills for v in (slot, ident, len(path.encode()), *path.encode())]
    out = [len(step.positions), len(step.rows), step.num_decodes, n_groups, len(step.logits_rows), len(score_rows),
           len(lora_slots or ()), len(fill_ints)]
    out += step.positions
    out += [v for row in step.rows for v in row]
    for g in range(n_groups):
        out += step.slots[g]
        out += [len(t) for t in step.tables[g]]
        out += [b for t in step.tables[g] for b in t]
    out += step.logits_rows
    out += score_rows
    out += lora_slots or ()
    return out + fill_ints


def decode(flat: list[int]) -> tuple[StepInputs, list[int], list[int], list[tuple[int, int, str]]]:
    """``encode``'s inverse: the step (without input ids or sampling state), its scored rows, its rows'
    LoRA slots and the adapters filled."""
    n_tok, n_rows, num_decodes, n_groups, n_logits, n_scores, n_lora, n_fill = flat[:8]
    i = 8

    def take(n: int) -> list[int]:
        nonlocal i
        i += n
        return flat[i - n:i]

    positions = take(n_tok)
    r = take(2 * n_rows)
    rows = list(zip(r[0::2], r[1::2]))
    slots, tables = [], []
    for _ in range(n_groups):
        slots.append(take(n_tok))
        lens = take(n_rows)
        tables.append([take(n) for n in lens])
    logits_rows = take(n_logits)
    score_rows = take(n_scores)
    lora_slots = take(n_lora)
    fills, end = [], i + n_fill
    while i < end:
        slot, ident, n = take(3)
        fills.append((slot, ident, bytes(take(n)).decode()))
    assert i == len(flat), (i, len(flat))
    return StepInputs([], positions, slots, rows, tables, num_decodes, logits_rows, []), score_rows, lora_slots, fills


class StepBroadcast:
    """Rank 0's end (``send``, ``stop``) and the other ranks' (``recv``)."""

    def __init__(self, device: torch.device):
        self.device = device  # where the backend takes tensors (NCCL: the GPU)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.broadcast(t, src=0)
        return t

    def send(self, step: StepInputs, score_rows: list[int], ids: torch.Tensor, lora_slots: list[int] | None = None,
             fills: list[tuple[int, int, str]] = ()) -> None:
        flat = encode(step, score_rows, lora_slots, fills)
        self._bcast(torch.tensor([STEP, len(flat)], dtype=torch.long))
        self._bcast(torch.tensor(flat, dtype=torch.long))
        self._bcast(ids)

    def stop(self) -> None:
        self._bcast(torch.tensor([STOP, 0], dtype=torch.long))

    def recv(self) -> tuple[StepInputs, list[int], torch.Tensor, list[int], list[tuple[int, int, str]]] | None:
        """The next step: (step, scored rows, input ids, rows' LoRA slots, adapters filled); None: stop."""
        head = self._bcast(torch.zeros(2, dtype=torch.long)).tolist()
        if head[0] == STOP:
            return None
        step, score_rows, lora_slots, fills = decode(self._bcast(torch.zeros(head[1], dtype=torch.long)).tolist())
        ids = self._bcast(torch.zeros(len(step.positions), dtype=torch.long))
        return step, score_rows, ids, lora_slots, fills
