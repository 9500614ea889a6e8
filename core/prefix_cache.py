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

State snapshots (for families whose sequences carry a recurrent state, e.g. SSM layers): a
node may hold a snapshot id, the state after the tokens of its path. KV blocks alone are
then not a usable hit: `match` returns the path only down to the deepest node with a
snapshot. Snapshots are few and dear, so they have their own pool and eviction policy
(Marconi, Pan et al. 2025): ``lru``, or ``flop_aware``, which keeps the snapshots that save
the most compute (see `_snapshot_victim`). A snapshot is evicted with its node's block, or
alone; never while a sequence holds its node's block, and only from a node with at most
one child (a branch point serves several continuations).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from heron.core.block_pool import BlockPool
from heron.core.slot_pool import SlotPool


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share cached KV: requests of one adapter ("" for the base model) and tenant."""

    adapter: str = ""
    tenant: str = ""


@dataclass(slots=True)
class Match:
    """What a lookup found. ``blocks`` (one new reference each, now the caller's) cover the
    reusable prefix; ``snapshot`` is the state after them (snapshot mode, else None);
    ``path_blocks`` counts the blocks of the whole cached path, reusable or not."""

    blocks: list[int] = field(default_factory=list)
    snapshot: int | None = None
    path_blocks: int = 0


class _Node:
    __slots__ = ("key", "block", "parent", "children", "depth", "snapshot", "used")

    def __init__(self, key, block: int, parent: _Node | None) -> None:
        self.key = key  # the block's tokens; the namespace for a root
        self.block = block  # -1 for a root
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.depth = parent.depth + 1 if parent is not None else 0  # blocks from the root
        self.snapshot = -1
        self.used = 0  # tick of the snapshot's last use


class PrefixCache:
    """Caches full KV blocks by prefix. Pure bookkeeping over a `BlockPool`."""

    EVICTION_POLICIES = ("lru", "flop_aware")

    def __init__(self, pool: BlockPool, block_size: int, eviction: str = "lru", *,
                 snapshots: SlotPool | None = None, flops_of=None,
                 flop_weight: float = 1.0) -> None:
        """``snapshots``: the snapshot pool, for snapshot mode. ``flops_of(num_tokens)``: the
        compute a prefix of that many tokens costs (``flop_aware`` eviction)."""
        if eviction not in self.EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        if eviction == "flop_aware" and snapshots is not None and flops_of(1) is None:
            raise ValueError("flop_aware eviction needs a model family that estimates its "
                             "FLOPs (ModelRunner.prefix_flops)")
        self.pool = pool
        self.block_size = block_size
        self.eviction = eviction
        self.snapshots = snapshots
        self.flops_of = flops_of
        self.flop_weight = flop_weight
        self._roots: dict[Namespace, _Node] = {}
        self._nodes: dict[int, _Node] = {}  # block id -> its node
        self._with_snapshot: set[_Node] = set()
        self._ticks = itertools.count(1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._with_snapshot)

    def _key(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[index * bs:(index + 1) * bs])

    def match(self, namespace: Namespace, token_ids: list[int], max_tokens: int) -> Match:
        """The longest reusable prefix of ``token_ids[:max_tokens]`` (whole blocks only) in
        ``namespace``: all of the cached path, or in snapshot mode the path down to its
        deepest snapshot."""
        node = self._roots.get(namespace)
        path: list[_Node] = []
        while node is not None and len(path) < max_tokens // self.block_size:
            node = node.children.get(self._key(token_ids, len(path)))
            if node is not None:
                path.append(node)
        found = Match(path_blocks=len(path))
        if self.snapshots is not None:
            while path and path[-1].snapshot < 0:
                path.pop()
            if path:
                path[-1].used = next(self._ticks)
                found.snapshot = path[-1].snapshot
        found.blocks = self.pool.fork([n.block for n in path])
        return found

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
            if node.snapshot >= 0:
                self._drop_snapshot(node)
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

    # -- snapshots ---------------------------------------------------------------------------

    def attach_snapshot(self, namespace: Namespace, token_ids: list[int], num_tokens: int,
                        snapshot: int) -> bool:
        """Give the cached node ending at ``num_tokens`` (block-aligned; inserted already) the
        snapshot of the state after those tokens. False, leaving ``snapshot`` to the caller,
        when that node is missing or already has one."""
        node = self._roots.get(namespace)
        for i in range(num_tokens // self.block_size):
            if node is None:
                return False
            node = node.children.get(self._key(token_ids, i))
        if node is None or node.parent is None or node.snapshot >= 0:
            return False
        node.snapshot, node.used = snapshot, next(self._ticks)
        self._with_snapshot.add(node)
        return True

    def evict_snapshot(self) -> bool:
        """Free one cached snapshot nobody is using, chosen by the eviction policy."""
        victim = self._snapshot_victim()
        if victim is None:
            return False
        self._drop_snapshot(victim)
        return True

    def _drop_snapshot(self, node: _Node) -> None:
        self.snapshots.free(node.snapshot)
        node.snapshot = -1
        self._with_snapshot.discard(node)

    def _snapshot_victim(self) -> _Node | None:
        """``lru``: the least recently used. ``flop_aware`` (Marconi): the lowest utility
        ``recency + flop_weight * flop_efficiency``, each normalised to [0, 1] over the
        candidates; flop efficiency is the compute a hit saves per byte held, and as every
        snapshot holds the same bytes, that is the compute of its prefix."""
        candidates = [n for n in self._with_snapshot
                      if len(n.children) <= 1 and self.pool.refcount(n.block) == 1]
        if not candidates or self.eviction == "lru":
            return min(candidates, key=lambda n: n.used, default=None)
        recency = _normalised([n.used for n in candidates])
        efficiency = _normalised([self.flops_of(n.depth * self.block_size) for n in candidates])
        utility = [r + self.flop_weight * e for r, e in zip(recency, efficiency)]
        return candidates[utility.index(min(utility))]


def _normalised(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [(v - lo) / (hi - lo) if hi > lo else 1.0 for v in values]
