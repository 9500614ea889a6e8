"""The paged-KV block pool: fixed-size blocks handed out by id, shared by refcount.

Pure bookkeeping (no tensors). Invariants: every refcount is >= 0; a block is on the free
list iff its refcount is 0; ``num_free_blocks + num_used_blocks == num_blocks``.

The prefix cache holds one reference on each block it caches and marks it with
`set_cached`. A cached block whose only reference is the cache's is *evictable*: the pool
keeps those in the order they became so (`evictable_lru`), so that the scheduler can tell in
O(1) how many blocks it could get by evicting and the cache can evict the least recently
used first.
"""

from __future__ import annotations

from collections import Counter, deque


class BlockPoolError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._evictable: dict[int, None] = {}  # insertion-ordered: least recently used first
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody but the cache references."""
        return len(self._evictable)

    def evictable_lru(self) -> int:
        """The evictable block that became evictable longest ago."""
        return next(iter(self._evictable))

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with refcount 1. Raises if too few are free."""
        if not self.can_allocate(num_blocks):
            raise BlockPoolError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with one more owner (refcount + 1 each); returns them."""
        for b in blocks:
            if self._refcounts[b] <= 0:
                raise BlockPoolError(f"cannot fork free block {b}")
        for b in blocks:
            self._refcounts[b] += 1
            if self._cached[b] and self._refcounts[b] == 2:
                del self._evictable[b]
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the pool."""
        for b, n in Counter(blocks).items():
            if self._refcounts[b] < n:
                raise BlockPoolError(f"double free of block {b}")
            if self._cached[b] and self._refcounts[b] == n:
                raise BlockPoolError(f"block {b} is cached: uncache it before its last free")
        for b in blocks:
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
            elif self._cached[b] and self._refcounts[b] == 1:
                self._evictable[b] = None

    def set_cached(self, block_id: int, cached: bool) -> None:
        """Mark a referenced block as holding one reference of the prefix cache (or not)."""
        if self._refcounts[block_id] <= 0:
            raise BlockPoolError(f"cannot (un)cache free block {block_id}")
        if self._cached[block_id] == cached:
            raise BlockPoolError(f"block {block_id} is already {'' if cached else 'un'}cached")
        self._cached[block_id] = cached
        if self._refcounts[block_id] == 1:
            if cached:
                self._evictable[block_id] = None
            else:
                del self._evictable[block_id]
