"""Which layers share a block table: KV layer groups (the layout of vLLM's hybrid KV cache manager).

A runtime declares each layer's attention: full, or a sliding window of W tokens. Layers of one kind
form groups, and each group has its own block table per request, drawn from the one block pool: a
full-attention group holds blocks for the whole sequence, a sliding group only for its window
(about W / block_size + 1 blocks; the blocks behind it go back to the pool as the window moves).

Every group has the same number of layers, `layers_per_block`, and layer i of every group reads and
writes KV tensor i: one block id is the KV of `layers_per_block` layers whichever group holds it, so
blocks stay the pool's one currency and what a request holds is counted exactly. Kinds of unequal
size (Gemma 3: five sliding layers per global one) are split as vLLM splits them: the group size is
the smallest kind's layer count (the largest's when all counts are within 25% of each other), each
kind is cut into that many groups, layers dealt to them in turn, and a group short of layers leaves
its blocks' unused tensor places empty (Gemma 3 27B: 10 global + 52 sliding layers -> 7 groups of at
most 10, 8 of the 70 places empty). A model without sliding layers is one group of all its layers:
the layout it always had.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NO_BLOCK = -1  # a sliding group's table entry behind its window: no block, never read


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # model layer indices; layer layers[i] uses KV tensor i


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first, then sliding ones by window
    layers_per_block: int  # KV tensors, and the layers whose KV one block id holds

    @classmethod
    def of(cls, windows: Sequence[int | None]) -> KVLayout:
        """The layout for layers whose windows are `windows` (None: full attention)."""
        assert windows and all(w is None or w > 0 for w in windows), windows
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            kinds.setdefault(w, []).append(layer)
        counts = [len(v) for v in kinds.values()]
        size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
        groups = []
        for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[w]
            n = cdiv(len(layers), size)
            groups += [KVGroup(w, tuple(layers[i::n])) for i in range(n)]
        return cls(tuple(groups), size)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """More than one block table per request."""
        return len(self.groups) > 1

    def placement(self) -> list[tuple[int, int]]:
        """Per layer of the layout: (its group, its KV tensor)."""
        place: list[tuple[int, int] | None] = [None] * sum(len(g.layers) for g in self.groups)
        for g, group in enumerate(self.groups):
            for t, layer in enumerate(group.layers):
                place[layer] = (g, t)
        assert all(p is not None for p in place), "a layer in no KV group"
        return place

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once when prefilled in chunks
        of at most `chunk` tokens: a chunk [s, e) holds a sliding group's blocks from position
        s - W + 1 on."""
        n = cdiv(num_tokens, block_size)
        return sum(n if w is None else min(n, cdiv(w - 1 + chunk, block_size) + 1) for w in self.windows)

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int) -> int | None:
        """The longest request that `num_blocks` blocks hold; None: any length (sliding groups
        only, whose blocks stop growing at their window)."""
        caps = [cdiv(w - 1 + chunk, block_size) + 1 for w in self.windows if w is not None]
        if None not in self.windows and sum(caps) <= num_blocks:
            return None
        lo, hi = 0, max([num_blocks] + caps) * block_size  # past it the count only grows or stays
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        """e.g. '1 full-attention and 3 sliding-window (8) groups of 1 layer'."""
        full = sum(1 for w in self.windows if w is None)
        sliding: dict[int, int] = {}
        for w in self.windows:
            if w is not None:
                sliding[w] = sliding.get(w, 0) + 1
        parts = [f"{full} full-attention"] if full else []
        parts += [f"{n} sliding-window ({w})" for w, n in sorted(sliding.items())]
        layers = "layer" if self.layers_per_block == 1 else "layers"
        return f"{' and '.join(parts)} groups of {self.layers_per_block} {layers}"


@dataclass(frozen=True)
class KVShape:
    """What one layer keeps per token: `heads` KV heads of `head_dim` values each in a K and a V cache, or
    with `shared` in one tensor that serves as both (multi-head latent attention's compressed latent and
    rotary key, which the attention reads as keys and as values)."""
    heads: int
    head_dim: int
    shared: bool = False

    @property
    def tensors(self) -> int:
        return 1 if self.shared else 2
