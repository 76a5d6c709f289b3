"""LoRA adapters of one engine: registered by name, read into host memory when first needed (at most
`max_cpu_loras` kept, least recently used first out), and run in one of `max_loras` slots of the
targeted layers while requests of them run.

The scheduler admits a request of an adapter only when the adapter has a slot or one is free (no
running request uses it): `acquire` at admission, `release` when the request finishes or is preempted.
A request keeps its slot as it runs; an adapter unloaded meanwhile stays in its slot until its last
running request ends. A server loads and unloads adapters from its event loop while the engine's thread
steps: the registry is changed under a lock, and only the engine's thread writes the slots."""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import torch

from pocketllm.core.request import Request
from pocketllm.distributed.parallel_state import get_tp
from pocketllm.errors import RequestError
from pocketllm.layers.lora import LoRARows, LoRASlots
from pocketllm.loaders.lora_adapter import LoRAAdapter, lora_layers, read_adapter


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, max_rows: int):
        """`max_rows`: the most rows of a step."""
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        targets = lora_layers(model)
        assert targets, "a runtime that declares LoRA has projections to target"
        first = next(iter(targets.values()))  # (the model's kernels: the GPU's group the rows by adapter)
        self.rows = LoRARows(max_loras, first.device, grouped=first.kernels.gpu, capacity=max_rows)
        self.layers: dict[str, LoRASlots] = {}
        for path, linear in targets.items():
            linear.lora = self.layers[path] = LoRASlots(linear.in_features, linear.out_sizes, self.rows, max_rank,
                                                        linear.dtype, linear.device)
        # (the CPU's one-call decoder computes the projections without adapters: steps with adapter rows skip it)
        model.lora_rows = self.rows
        self.paths: dict[str, tuple[str, int]] = {}  # name -> (path, the load's identity)
        self.sources: dict[int, str] = {}  # identity -> path, kept after an unload (requests of it may wait)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # identity -> the adapter read, LRU
        self.slot_id = [0] * max_loras  # the identity of the adapter in each slot (0: none)
        self.users = [0] * max_loras  # running requests in each slot
        self._ids = itertools.count(1)
        self.tp_size = get_tp().size
        self._fills: list[tuple[int, int, str]] = []  # (slot, identity, path) not yet sent to the other ranks
        self._lock = threading.Lock()

    # -- adapters by name ------------------------------------------------------------------------
    def load(self, name: str, path: str) -> None:
        """Register adapter `name` (replacing one of that name); read and checked now, so that an
        adapter that cannot run here is refused at once (ConfigurationError)."""
        adapter = read_adapter(name, path, self.model, self.max_rank)
        with self._lock:
            ident = next(self._ids)
            self.paths[name] = (str(path), ident)
            self.sources[ident] = str(path)
            self._keep(ident, adapter)

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self.paths:
                raise RequestError(f"no LoRA adapter named {name!r} is loaded")
            _, ident = self.paths.pop(name)
            self.host.pop(ident, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self.paths)

    def path(self, name: str) -> str:
        return self.paths[name][0]

    def identity(self, name: str) -> int:
        """The identity of adapter `name`'s current load (a request records it when it is added)."""
        with self._lock:
            if name not in self.paths:
                raise RequestError(f"no LoRA adapter named {name!r} is loaded; loaded: {', '.join(self.paths) or 'none'}")
            return self.paths[name][1]

    # -- slots, for the scheduler ----------------------------------------------------------------
    def acquire(self, req: Request) -> bool:
        """Give `req` its adapter's slot, loading the adapter into a free one if it has none; False when
        every slot runs another adapter's requests (the request waits)."""
        if not req.lora_id:
            return True
        if req.lora_id in self.slot_id:
            slot = self.slot_id.index(req.lora_id)
        else:
            free = [s for s, n in enumerate(self.users) if n == 0]
            if not free:
                return False
            slot = next((s for s in free if self.slot_id[s] == 0), free[0])
            self._fill(slot, req)
        self.users[slot] += 1
        req.lora_slot = slot
        return True

    def release(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.users[req.lora_slot] -= 1
            assert self.users[req.lora_slot] >= 0
            req.lora_slot = -1

    def _fill(self, slot: int, req: Request) -> None:
        path = self.sources[req.lora_id]
        self._put(slot, self._adapter(req.lora_id, req.lora_name, path))
        self.slot_id[slot] = req.lora_id
        if self.tp_size > 1:
            self._fills.append((slot, req.lora_id, path))

    def _adapter(self, ident: int, name: str, path: str) -> LoRAAdapter:
        """Adapter load `ident` from host memory, or read again from `path` (never read here yet, evicted from
        host memory, or unloaded while requests of it waited)."""
        with self._lock:
            adapter = self.host.get(ident)
            if adapter is not None:
                self.host.move_to_end(ident)
                return adapter
        adapter = read_adapter(name, path, self.model, self.max_rank)
        with self._lock:
            self._keep(ident, adapter)
        return adapter

    def _put(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        for path, parts in adapter.weights.items():
            for part, a, b in parts:
                self.layers[path].put(slot, part, a, b)

    # -- tensor parallelism: the other ranks fill their shares of the same slots ------------------
    def take_fills(self) -> list[tuple[int, int, str]]:
        """Rank 0: the (slot, identity, path) filled since the last call, for the other ranks."""
        fills, self._fills = self._fills, []
        return fills

    def fill_from(self, slot: int, ident: int, path: str) -> None:
        """A rank other than 0: rank 0 put adapter `ident` (read from `path`) into `slot`."""
        self._put(slot, self._adapter(ident, f"#{ident}", path))

    def _keep(self, ident: int, adapter: LoRAAdapter) -> None:
        self.host[ident] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
