"""The radix prefix cache: full KV blocks indexed by the tokens they hold, one tree per namespace.

A trie whose edges are whole blocks (SGLang's RadixAttention at block granularity): the
node at depth ``d`` stands for the block holding tokens ``[d*bs, (d+1)*bs)`` of every
sequence whose first ``(d+1)*bs`` tokens spell the path to it. Each `Namespace` (adapter,
tenant) has its own root, so a lookup never sees another namespace's blocks.

Ownership: the cache holds one pool reference on each node's block (marked with
``BlockPool.set_cached``); a sequence holds its own reference on every block of its table.
`match` takes the caller's references. A block is evicted only when the cache's reference
is its last, so a block a sequence uses is never evicted.

Two invariants make eviction exact and O(1) per block:
  - *paths*: the cached blocks a sequence holds are a path from the root (`insert` swaps a
    sequence's duplicate of a cached block for the cached one; whoever shares a sequence's
    blocks with another inserts them first). So a node whose block only the cache
    references heads a subtree that only the cache references, and
    ``pool.num_evictable_blocks`` is exactly what eviction can free.
  - *tail first*: owners free a block table from its end. With *paths*, a child's last
    holder drops it before its parent, so a child becomes evictable before its parent, and
    evicting in the pool's least-recently-used order always takes a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass

from heron.core.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share cached KV: requests of one adapter ("" for the base model) and tenant."""

    adapter: str = ""
    tenant: str = ""


class _Node:
    __slots__ = ("key", "block", "parent", "children")

    def __init__(self, key, block: int, parent: _Node | None) -> None:
        self.key = key  # the block's tokens; the namespace for a root
        self.block = block  # -1 for a root
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class PrefixCache:
    """Caches full KV blocks by prefix. Pure bookkeeping over a `BlockPool`."""

    EVICTION_POLICIES = ("lru",)

    def __init__(self, pool: BlockPool, block_size: int, eviction: str = "lru") -> None:
        if eviction not in self.EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Namespace, _Node] = {}
        self._nodes: dict[int, _Node] = {}  # block id -> its node

    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    def _key(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[index * bs:(index + 1) * bs])

    def match(self, namespace: Namespace, token_ids: list[int], max_tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of ``token_ids[:max_tokens]`` (whole blocks
        only) in ``namespace``, each with a new reference that the caller now owns."""
        node = self._roots.get(namespace)
        blocks: list[int] = []
        if node is None:
            return blocks
        for i in range(max_tokens // self.block_size):
            node = node.children.get(self._key(token_ids, i))
            if node is None:
                break
            blocks.append(node.block)
        return self.pool.fork(blocks)

    def insert(self, namespace: Namespace, token_ids: list[int], block_table: list[int],
               num_tokens: int) -> None:
        """Cache the whole blocks among the first ``num_tokens`` tokens, whose KV is written in
        ``block_table`` (a sequence's, which keeps its references).

        Where a block with the same prefix is already cached, the table entry is switched to
        the cached block and the sequence's own copy released: the KV is the same, and the
        *paths* invariant needs it.
        """
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(namespace, -1, None)
        node = root
        for i in range(num_tokens // self.block_size):
            key = self._key(token_ids, i)
            own = block_table[i]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, own, node)
                self._nodes[own] = child
                self.pool.fork([own])
                self.pool.set_cached(own, True)
            elif child.block != own:
                block_table[i] = self.pool.fork([child.block])[0]
                self.pool.free([own])
            node = child
        if not root.children:
            del self._roots[namespace]

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks only the cache references, least recently used
        first; returns how many."""
        pool = self.pool
        num_blocks = min(num_blocks, pool.num_evictable_blocks)
        for _ in range(num_blocks):
            node = self._nodes[pool.evictable_lru()]
            assert not node.children, "evicting a node with children (tail-first broken?)"
            parent = node.parent
            del parent.children[node.key]
            del self._nodes[node.block]
            pool.set_cached(node.block, False)
            pool.free([node.block])
            if parent.parent is None and not parent.children:
                del self._roots[parent.key]
        return num_blocks

    def namespace_of(self, block: int) -> Namespace | None:
        """The namespace a cached block belongs to (None when not cached)."""
        node = self._nodes.get(block)
        if node is None:
            return None
        while node.parent is not None:
            node = node.parent
        return node.key
