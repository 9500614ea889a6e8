"""The paged-KV block pool: fixed-size blocks handed out by id, shared by refcount.

Pure bookkeeping (no tensors). Invariants: every refcount is >= 0; a block is on the free
list iff its refcount is 0; ``num_free_blocks + num_used_blocks == num_blocks``.
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
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

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
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the pool."""
        for b, n in Counter(blocks).items():
            if self._refcounts[b] < n:
                raise BlockPoolError(f"double free of block {b}")
        for b in blocks:
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
