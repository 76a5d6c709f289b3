"""KV block accounting for requests: block tables, prefix-cache lookups, chained block hashes."""
from __future__ import annotations

import hashlib
from array import array

from pocketllm.engine.block_pool import BlockPool, KVBlock
from pocketllm.engine.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """sha256 over the parent block's hash and this block's token ids (int64, little endian)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 hash_salt: bytes = b""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
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

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        while len(req.block_hashes) < num_tokens // bs:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else self.root_hash
            req.block_hashes.append(hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs]))

    def find_cached_blocks(self, req: Request) -> list[KVBlock]:
        """The longest chain of cached full blocks that prefixes the request's tokens. The last
        token is always left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        hits = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       cached_blocks: list[KVBlock] = (), reserve: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens beyond what it has computed
        (plus the cached blocks it is adopting). Leaves `reserve` blocks free, or fails
        without changing anything."""
        num_computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(req.block_ids) - len(cached_blocks)
        # Cached blocks nobody references sit in the free list; taking them shrinks it too.
        num_revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free - reserve:
            return False
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            req.block_ids.extend(b.block_id for b in cached_blocks)
            req.num_hashed_blocks = len(req.block_ids)
        if num_new_blocks > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full blocks whose KV is written (or being written by a launched
        step) and whose tokens are all known."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        self._update_hashes(req, num_full * self.block_size)
        blocks = self.pool.blocks
        for i in range(req.num_hashed_blocks, num_full):
            self.pool.register(blocks[req.block_ids[i]], req.block_hashes[i])
        req.num_hashed_blocks = num_full

    def forget_exclusive_blocks(self, req: Request) -> None:
        """Unregister the hashed blocks that only `req` references: their KV may never have been
        written (a failed step), so no later request may take them as a prefix hit."""
        blocks = self.pool.blocks
        for i in req.block_ids[:req.num_hashed_blocks]:
            if blocks[i].ref_cnt == 1:
                self.pool.unregister(blocks[i])

    def free(self, req: Request) -> None:
        """Release the request's blocks, last block first, so chain tails are evicted before
        the shared heads that other requests are more likely to reuse."""
        blocks = self.pool.blocks
        self.pool.free([blocks[i] for i in reversed(req.block_ids)])
        req.block_ids = []
        req.num_hashed_blocks = 0
