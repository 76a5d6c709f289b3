"""Experts in host memory, copied to the GPU as steps select them (cpu_offload_experts with
expert_offload="copy"): the other of the two ways to run a model whose experts do not fit the GPU.

A layer's experts are built in the GPU's encoding (its Triton GGUF blocks, or its dense weights) but in
host memory (pinned on CUDA), stacked as the resident grouped kernels take them (`ExpertStack`). The
device holds `slots` experts' worth of each stack. Each step reads its routing on the host (one sync
a layer), copies the experts it selected that no slot holds into slots, and runs the resident path's
kernels on the slots, each pair pointed at its expert's slot. Which experts stay is decided by how often
the router selected them (a count that halves every `HALF_LIFE` selections of the layer, so that the
set follows the traffic): the least selected resident expert not needed now makes room, the least
recently used of those on a tie. Hot experts stay resident; a one-off selection does not push them out.
The routing, the kernels and so the outputs are the resident path's: offload changes where weights
live, not what is computed.

A step that selects more experts than there are slots (a long prompt's chunk) runs in rounds of
`slots` experts, each pair counted in the round that holds its expert (weight 0 in the others)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from pocketllm.kernels.platform import staged_for

HALF_LIFE = 4096  # selections of a layer's experts (token-expert pairs) after which its counts halve


class ExpertCache:
    def __init__(self, stacks, num_experts: int, slots: int, device: torch.device):
        """`stacks`: the layer's (gate_up, down) ExpertStacks over host memory; their parts are
        re-pointed at `slots` experts' worth of `device` memory."""
        assert 0 < slots, slots
        self.num_experts, self.slots, self.device = num_experts, min(slots, num_experts), device
        self.host, self.parts = [], []
        for stack in stacks:
            if stack.bias is not None:
                stack.bias = stack.bias.to(device)  # (indexed by expert: small)
            for part in stack.parts:
                rows = part.stacked.shape[0] // num_experts
                host = staged_for(part.stacked, device)
                part.rehome(host)  # (the experts' layers point there too: the unpinned copy is freed)
                self.host.append(host.view(num_experts, rows, *host.shape[1:]))
                part.stacked = torch.zeros((self.slots * rows, *host.shape[1:]), dtype=host.dtype, device=device)
                if part.bias is not None:
                    part.bias = part.bias.to(device)
                self.parts.append(part)
        self.resident: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.free = list(range(self.slots))
        self.table = torch.zeros(num_experts, dtype=torch.long, device=device)  # expert -> slot, on the device
        self.selected = torch.zeros(num_experts, dtype=torch.float64)  # how often the router chose each (decaying)
        self._since_halved = 0
        self.copied = self.hits = 0  # experts copied in, and selected while resident (statistics)

    def count(self, counts: torch.Tensor) -> None:
        """The router chose each expert `counts[e]` times (token-expert pairs) in a step."""
        self.selected += counts
        self._since_halved += int(counts.sum())
        if self._since_halved >= HALF_LIFE:
            self.selected /= 2
            self._since_halved = 0

    def fetch(self, experts: list[int]) -> None:
        """`experts` (at most `slots`, distinct) into slots, evicting the least selected others."""
        assert len(experts) <= self.slots
        wanted, selected = set(experts), self.selected.tolist()
        for e in experts:
            if e in self.resident:
                self.resident.move_to_end(e)
                self.hits += 1
                continue
            if self.free:
                slot = self.free.pop()
            else:
                # (`resident` runs from least to most recently used: min keeps the first of equal counts)
                victim = min((v for v in self.resident if v not in wanted), key=selected.__getitem__)
                slot = self.resident.pop(victim)
            self.resident[e] = slot
            for host, part in zip(self.host, self.parts):
                rows = host.shape[1]
                part.stacked[slot * rows:(slot + 1) * rows].copy_(host[e], non_blocking=True)
            self.table[e] = slot
            self.copied += 1

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, stacked) -> torch.Tensor:
        """The layer's experts on x [T, hidden] for the routing (weights, ids [T, k]); `stacked` is
        SparseMoE._stacked (the resident kernels, given each pair's slot; the grouped GEMVs at any
        number of tokens where the tile kernel does not cover the stacks)."""
        counts = torch.bincount(ids.flatten().cpu(), minlength=self.num_experts)  # (waits for the routing)
        self.count(counts)
        selected = counts.nonzero().flatten().tolist()
        out = None
        for i in range(0, len(selected), self.slots):
            group = selected[i:i + self.slots]
            self.fetch(group)
            w = weights
            if len(group) < len(selected):  # a round: the pairs of the others weigh nothing
                mask = torch.zeros(self.num_experts, dtype=torch.bool, device=ids.device)
                mask[torch.tensor(group, device=ids.device)] = True
                w = torch.where(mask[ids], weights, 0.0)
            y = stacked(x, w, ids, self.table[ids], self.slots, grouped_max=x.shape[0])
            out = y if out is None else out + y
        return out
