"""Fixed-size KV blocks: a pool with reference counts, an LRU free list and a hash index.

A freed block keeps its hash and goes to the tail of the free list; it is evicted lazily,
only when it is handed out again. So the longer a freed block goes unused, the sooner it
is reused, and until then a request with the same prefix can take it back.

The index is keyed by (KV group, block hash): with several layer groups (kv_groups) the same
tokens have a block per group, each holding its own layers' KV.
"""
from __future__ import annotations


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group = 0  # the KV group whose content the hash names
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head first): O(1) popleft,
    append and removal from the middle (a cached block taken back by a prefix hit)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        assert block is not self._tail, "no free blocks"
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[tuple[int, bytes], KVBlock] = {}

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        assert n <= self.num_free, f"asked for {n} blocks, {self.num_free} free"
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self.unregister(block)  # lazy eviction of the cached content
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the LRU tail in the order given."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes, group: int = 0) -> KVBlock | None:
        return self.cached.get((group, block_hash))

    def register(self, block: KVBlock, block_hash: bytes, group: int = 0) -> None:
        """Make a full, written block of `group` findable by its hash. If identical content is
        already cached in another block, keep that one: this block stays anonymous."""
        key = (group, block_hash)
        if block.block_hash is not None or key in self.cached:
            return
        block.block_hash, block.group = block_hash, group
        self.cached[key] = block

    def unregister(self, block: KVBlock) -> None:
        key = (block.group, block.block_hash)
        if block.block_hash is not None and self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash = None

    def check_integrity(self) -> None:
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert referenced + self.num_free == self.num_blocks, (referenced, self.num_free)
        for (g, h), b in self.cached.items():
            assert b.block_hash == h and b.group == g
