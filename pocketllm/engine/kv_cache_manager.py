"""KV block accounting for requests: a block table per KV group, prefix-cache lookups, chained
block hashes.

Every group's table draws on the one pool (kv_groups). A full-attention group holds a block for
each block of tokens; a sliding group of window W releases a block once every query still to
come is past its last position + W (vLLM's rule: at allocation, the blocks wholly before
position num_computed_tokens - W + 1), leaving NO_BLOCK in its place.

Prefix caching works per group, as in vLLM's hybrid coordinator: block hashes are the request's
(one chain for every group), the pool's index is keyed by (group, hash), and a released sliding
block keeps its hash until evicted. A hit of L tokens needs every full group's blocks before L and
each sliding group's last ceil((W - 1) / block_size) blocks before L (what the query at L sees);
the longest L all groups agree on is found from the full groups' hit downward.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pocketllm.core.kv_layout import NO_BLOCK
from pocketllm.core.request import Request
from pocketllm.engine.block_pool import BlockPool, KVBlock


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """sha256 over the parent block's hash and this block's token ids (int64, little endian)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass
class PrefixHit:
    """Cached blocks for a request's first `num_tokens` tokens: per group, one entry per logical
    block (None behind a sliding group's window)."""

    tables: list[list[KVBlock | None]]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 hash_salt: bytes = b"", windows: Sequence[int | None] = (None,), lookahead: bool = False):
        """`lookahead`: some layers' KV at a position depends on the token after it too (a
        next-token-prediction draft layer's): a hit leaves its last block to compute, the only
        one whose last position's successor was not part of the match (vLLM drops it too)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lookahead = lookahead
        self.pool = BlockPool(num_blocks)
        self.windows = tuple(windows)  # per KV group: None (full attention) or its window in tokens
        self.sliding = [g for g, w in enumerate(self.windows) if w is not None]
        # per sliding group: the blocks before a hit's end that its query sees
        self.window_blocks = {g: -(-(self.windows[g] - 1) // block_size) for g in self.sliding}
        # The chain's root covers everything that changes what a block's KV holds
        # besides its tokens: the model, its dtype and KV geometry.
        self.root_hash = hashlib.sha256(b"pocketllm-kv:" + hash_salt).digest()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def num_held_blocks(self, req: Request) -> int:
        return sum(len(t) - r for t, r in zip(req.block_tables, req.num_released))

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        while len(req.block_hashes) < num_tokens // bs:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else self._root(req)
            req.block_hashes.append(hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs]))

    def _root(self, req: Request) -> bytes:
        """The hash a request's chain starts from: a request with a cache_salt hits only blocks
        computed under the same salt (so that `cached_tokens` tells nothing of other users' prompts),
        one with a LoRA adapter only blocks computed under the same load of it."""
        root = self.root_hash
        if req.lora_id:
            root = hashlib.sha256(root + b"lora:%d" % req.lora_id).digest()
        if req.cache_salt is None:
            return root
        return hashlib.sha256(root + b"salt:" + req.cache_salt.encode("utf-8", "surrogatepass")).digest()

    def find_cached_blocks(self, req: Request) -> PrefixHit | None:
        """The longest prefix of cached full blocks every group can resume from. The last token
        is always left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return None
        n = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, n * self.block_size)
        hashes, lookup = req.block_hashes, self.pool.lookup
        for g, w in enumerate(self.windows):
            if w is None:  # a full group's hits are a prefix: any shorter hit holds too
                i = 0
                while i < n and lookup(hashes[i], g) is not None:
                    i += 1
                n = i
        if self.lookahead:
            n = max(n - 1, 0)
        # A sliding group's hit at n says nothing about shorter ones, and a shorter one in one
        # group may shorten another's: go round until they agree.
        changed = bool(self.sliding)
        while changed and n:
            changed = False
            for g in self.sliding:
                m = self._sliding_hit(hashes, n, g)
                if m < n:
                    n, changed = m, True
        if n == 0:
            return None
        tables = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else max(0, n - self.window_blocks[g])
            tables.append([None] * first + [lookup(h, g) for h in hashes[first:n]])
        return PrefixHit(tables, n * self.block_size)

    def _sliding_hit(self, hashes: list[bytes], n: int, g: int) -> int:
        """The longest hit of at most n blocks for sliding group g: its last window_blocks[g]
        blocks cached (or every block from the first on, when the window reaches back that far)."""
        need, run = self.window_blocks[g], 0
        if need == 0:
            return n
        for i in range(n - 1, -1, -1):
            if self.pool.lookup(hashes[i], g) is None:
                run = 0
            else:
                run += 1
                if run == need:
                    return i + need
        return run

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       reserve: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens beyond what it has computed (plus
        the cached blocks of `hit`, which it adopts). Leaves `reserve` blocks free, or fails
        without taking any block. Sliding groups first release the blocks behind their window:
        this step's first query is at num_computed_tokens, and nothing later looks further back."""
        bs = self.block_size
        if not req.block_tables:
            req.block_tables = [[] for _ in self.windows]
            req.num_released = [0] * len(self.windows)
        if self.sliding:
            self._release_behind_window(req)
        start = req.num_computed_tokens
        if hit:
            assert not any(req.block_tables), f"prefix hit for a request holding blocks: {req}"
            start += hit.num_tokens
        num_needed = -(-(start + num_new_tokens) // bs)
        if hit is None:  # most steps of a request: its blocks hold the new tokens already
            for table in req.block_tables:
                if len(table) < num_needed:
                    break
            else:
                return True
        # New blocks extend every table to num_needed: a sliding group's table already reaches the
        # first block its queries see (the last step's end, or a hit's window).
        num_new_blocks = num_revived = 0
        for g, table in enumerate(req.block_tables):
            num_new_blocks += max(0, num_needed - len(table) - (len(hit.tables[g]) if hit else 0))
            if hit:  # cached blocks nobody references sit in the free list; taking them shrinks it too
                num_revived += sum(1 for b in hit.tables[g] if b is not None and b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free - reserve:
            return False
        if hit:  # (adopted at admission only: the tables are empty) before any allocation can evict them
            for g, cached in enumerate(hit.tables):
                self.pool.touch([b for b in cached if b is not None])
                req.num_released[g] = sum(1 for b in cached if b is None)
                req.block_tables[g].extend(NO_BLOCK if b is None else b.block_id for b in cached)
            req.num_hashed_blocks = hit.num_tokens // bs
        for table in req.block_tables:
            if num_needed > len(table):
                table.extend(b.block_id for b in self.pool.allocate(num_needed - len(table)))
        return True

    def _release_behind_window(self, req: Request) -> None:
        """Return each sliding group's blocks wholly before position num_computed_tokens - W + 1 to
        the pool. They are registered first, so that they stay findable by their hash."""
        bs, blocks = self.block_size, self.pool.blocks
        released = []
        for g in self.sliding:
            end = max(0, req.num_computed_tokens - self.windows[g] + 1) // bs
            r = req.num_released[g]
            if end <= r:
                continue
            self.cache_computed_blocks(req)  # (returns at once after the first group)
            table = req.block_tables[g]
            assert end <= len(table) and NO_BLOCK not in table[r:end], (req, g, end)
            released += [blocks[i] for i in table[r:end]]
            table[r:end] = [NO_BLOCK] * (end - r)
            req.num_released[g] = end
        if released:
            self.pool.free(released)

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full blocks whose KV is written (or being written by a launched
        step) and whose tokens are all known."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        self._update_hashes(req, num_full * self.block_size)
        blocks, hashes = self.pool.blocks, req.block_hashes
        for g, table in enumerate(req.block_tables):
            for i in range(req.num_hashed_blocks, num_full):
                if table[i] != NO_BLOCK:  # (released before its tokens were known: not findable)
                    self.pool.register(blocks[table[i]], hashes[i], g)
        req.num_hashed_blocks = num_full

    def forget_exclusive_blocks(self, req: Request) -> None:
        """Unregister the hashed blocks that only `req` references: their KV may never have been
        written (a failed step), so no later request may take them as a prefix hit. A sliding
        group's released blocks under the request's hashes go too, if nobody holds them."""
        blocks = self.pool.blocks
        for g, table in enumerate(req.block_tables):
            for i in range(req.num_hashed_blocks):
                if table[i] != NO_BLOCK:
                    if blocks[table[i]].ref_cnt == 1:
                        self.pool.unregister(blocks[table[i]])
                elif (block := self.pool.lookup(req.block_hashes[i], g)) is not None and block.ref_cnt == 0:
                    self.pool.unregister(block)

    def free(self, req: Request) -> None:
        """Release the request's blocks, last block first, so chain tails are evicted before
        the shared heads that other requests are more likely to reuse."""
        blocks = self.pool.blocks
        for table, released in zip(req.block_tables, req.num_released):
            self.pool.free([blocks[i] for i in reversed(table[released:])])
        req.block_tables = []
        req.num_released = []
        req.num_hashed_blocks = 0
