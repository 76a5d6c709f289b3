"""The tensor-parallel group of this process: its rank, its size and the collectives the layers
call (torch.distributed: gloo on the CPU, NCCL on CUDA).

Layers read the group when they are built (``get_tp()``), so a model built inside
``tensor_parallel(group)`` holds this rank's shard of every weight. With one rank every
collective is the identity and nothing here touches torch.distributed."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of ``n`` (``n`` divisible by the size)."""
        assert n % self.size == 0, f"{n} does not split over {self.size} ranks"
        per = n // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads: an even share, or with fewer heads than ranks
        one head replicated on size // num_kv_heads ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


_TP = TPGroup()


def get_tp() -> TPGroup:
    return _TP


@contextmanager
def tensor_parallel(group: TPGroup):
    """Build (or run) layers as ``group``'s rank."""
    global _TP
    old, _TP = _TP, group
    try:
        yield group
    finally:
        _TP = old


def set_tp(group: TPGroup) -> None:
    """This process's group for good (a worker process, which only ever serves one rank)."""
    global _TP
    _TP = group
