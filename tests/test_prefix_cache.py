"""The radix prefix cache over the block pool: matching, sharing, namespaces, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from heron.core.block_pool import BlockPool, BlockPoolError
from heron.core.prefix_cache import Namespace, PrefixCache
from heron.core.slot_pool import SlotPool

BS = 4
A, B = Namespace(tenant="a"), Namespace(tenant="b")


def make(num_blocks=32):
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, BS)


def write(pool, cache, ns, tokens):
    """A sequence that computed ``tokens``: its own blocks, inserted into the cache."""
    table = pool.allocate(-(-len(tokens) // BS))
    cache.insert(ns, tokens, table, len(tokens))
    return table


def test_match_returns_whole_blocks_of_the_longest_prefix_and_takes_refs():
    pool, cache = make()
    tokens = list(range(10))
    table = write(pool, cache, A, tokens)
    assert cache.num_cached_blocks == 2  # the partial third block is not cached
    got = cache.match(A, tokens + [99], 11).blocks
    assert got == table[:2]
    assert [pool.refcount(b) for b in got] == [3, 3]  # writer, cache, matcher
    assert cache.match(A, [0, 1, 2, 3, 7, 7, 7, 7], 8).blocks == table[:1]
    assert cache.match(A, tokens, 7).blocks == table[:1]  # max_tokens caps the match
    assert cache.match(A, [5] + tokens, 11).blocks == []


def test_namespaces_never_share_blocks():
    pool, cache = make()
    tokens = list(range(8))
    write(pool, cache, A, tokens)
    assert cache.match(B, tokens, 8).blocks == []
    table_b = write(pool, cache, B, tokens)  # B computes its own: two separate subtrees
    assert cache.num_cached_blocks == 4
    assert {cache.namespace_of(b) for b in table_b} == {B}
    assert set(cache.match(B, tokens, 8).blocks) == set(table_b)


def test_insert_of_a_duplicate_swaps_the_sequence_onto_the_cached_block():
    pool, cache = make()
    tokens = list(range(8))
    first = write(pool, cache, A, tokens)
    second = pool.allocate(2)
    own = list(second)
    cache.insert(A, tokens, second, 8)
    assert second == first  # now sharing the cached blocks
    assert all(pool.refcount(b) == 0 for b in own)  # its own copies went back to the pool
    assert cache.num_cached_blocks == 2


def test_eviction_is_lru_takes_leaves_first_and_spares_referenced_blocks():
    pool, cache = make(num_blocks=8)
    old = write(pool, cache, A, list(range(8)))
    new = write(pool, cache, A, list(range(100, 108)))
    held = write(pool, cache, B, list(range(200, 208)))  # still held by its sequence
    pool.free(old[::-1])  # owners release tail first
    pool.free(new[::-1])
    assert pool.num_evictable_blocks == 4 and pool.num_free_blocks == 2
    cache.match(A, list(range(100, 108)), 8)  # use `new` again
    pool.free(new[::-1])
    assert cache.evict(1) == 1
    assert pool.refcount(old[1]) == 0 and pool.refcount(old[0]) == 1  # leaf of the LRU path
    assert cache.evict(10) == 3  # everything unreferenced, not the held blocks
    assert all(pool.refcount(b) == 2 for b in held)
    assert cache.num_cached_blocks == 2 and pool.num_evictable_blocks == 0


def test_a_cached_block_cannot_be_freed_from_under_the_cache():
    pool, cache = make()
    table = write(pool, cache, A, list(range(4)))
    pool.free(table)
    with pytest.raises(BlockPoolError):
        pool.free(table)  # the cache's reference is the cache's to drop
    assert cache.evict(5) == 1 and pool.num_free_blocks == pool.num_blocks


# -- a state machine over cache + pool ---------------------------------------------------

NUM_BLOCKS = 16
NAMESPACES = [Namespace(tenant=t) for t in ("", "x")] + [Namespace(adapter="lora", tenant="")]
# sequences made of a few block patterns (and a partial tail), so that prefixes collide often
PATTERNS = [(0,) * BS, (1,) * BS, (0, 1) * (BS // 2)]
token_lists = st.builds(lambda blocks, tail: [t for b in blocks for t in b] + tail,
                        st.lists(st.sampled_from(PATTERNS), max_size=4),
                        st.lists(st.integers(0, 1), max_size=BS - 1)).filter(bool)


class CacheMachine(RuleBasedStateMachine):
    """Sequences (ns, tokens, table) hold one reference per table entry; the cache holds
    one per node. Rules run in any order; the invariants must hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = PrefixCache(self.pool, BS)
        self.seqs: list[tuple[Namespace, list[int], list[int]]] = []

    def _evict(self, n: int) -> int:
        refs = [self.pool.refcount(b) for b in range(NUM_BLOCKS)]
        freed = self.cache.evict(n)
        for b in range(NUM_BLOCKS):  # only blocks referenced by the cache alone went
            if self.pool.refcount(b) != refs[b]:
                assert refs[b] == 1 and self.pool.refcount(b) == 0
        return freed

    def _ensure(self, n: int) -> bool:
        short = n - self.pool.num_free_blocks
        if short > 0:
            if short > self.pool.num_evictable_blocks:
                return False
            assert self._evict(short) == short  # num_evictable_blocks is exact
        return True

    @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists)
    def match_then_compute(self, ns, tokens):
        """Lookup (locks the matched blocks), then allocate the rest or release the lookup."""
        table = self.cache.match(ns, tokens, len(tokens) - 1).blocks
        assert len(table) * BS <= len(tokens) - 1
        for b in table:
            assert self.cache.namespace_of(b) == ns  # a match never crosses namespaces
        rest = -(-len(tokens) // BS) - len(table)
        if not self._ensure(rest):
            self.pool.free(table[::-1])
            return
        table += self.pool.allocate(rest)
        self.seqs.append((ns, tokens, table))

    @rule(pick=st.integers(0, 100), cut=st.integers(0, 5 * BS))
    @precondition(lambda self: self.seqs)
    def insert(self, pick, cut):
        ns, tokens, table = self.seqs[pick % len(self.seqs)]
        self.cache.insert(ns, tokens, table, min(cut, len(tokens)))

    @rule(pick=st.integers(0, 100))
    @precondition(lambda self: self.seqs)
    def fork(self, pick):
        """As the engine forks a prompt: cached first, so the copy holds only cached blocks
        (and the private partial block)."""
        ns, tokens, table = self.seqs[pick % len(self.seqs)]
        self.cache.insert(ns, tokens, table, len(tokens))
        self.seqs.append((ns, list(tokens), self.pool.fork(table)))

    @rule(pick=st.integers(0, 100), insert=st.booleans())
    @precondition(lambda self: self.seqs)
    def finish(self, pick, insert):
        ns, tokens, table = self.seqs.pop(pick % len(self.seqs))
        if insert:
            self.cache.insert(ns, tokens, table, len(tokens))
        self.pool.free(table[::-1])  # tail first, as the scheduler does

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n):
        evictable = self.pool.num_evictable_blocks
        assert self._evict(n) == min(n, evictable)

    @invariant()
    def refcounts_are_exactly_the_holders(self):
        expected = [0] * NUM_BLOCKS
        for _, _, table in self.seqs:
            for b in table:
                expected[b] += 1
        cached = [self.pool.is_cached(b) for b in range(NUM_BLOCKS)]
        for b in range(NUM_BLOCKS):
            expected[b] += cached[b]
        assert [self.pool.refcount(b) for b in range(NUM_BLOCKS)] == expected
        assert self.pool.num_free_blocks == expected.count(0)  # free iff unreferenced
        assert self.cache.num_cached_blocks == sum(cached)
        assert self.pool.num_evictable_blocks == sum(
            1 for b in range(NUM_BLOCKS) if cached[b] and expected[b] == 1)

    @invariant()
    def sequences_hold_only_their_namespace_and_paths_from_the_root(self):
        for ns, tokens, table in self.seqs:
            seen_uncached = False
            for i, b in enumerate(table):
                owner = self.cache.namespace_of(b)
                if owner is None:
                    seen_uncached = True
                    continue
                assert owner == ns
                assert not seen_uncached, "a cached block below an uncached one"
                path = self.cache.match(ns, tokens, (i + 1) * BS).blocks
                self.pool.free(path[::-1])
                assert path[i] == b


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_cache_state_machine = CacheMachine.TestCase


# -- state snapshots (families with recurrent state) ---------------------------------------

def make_snapshot_cache(num_blocks=32, num_snapshots=4, eviction="lru"):
    pool, snapshots = BlockPool(num_blocks), SlotPool(num_snapshots)
    cache = PrefixCache(pool, BS, eviction, snapshots=snapshots,
                        flops_of=lambda n: float(n * n), flop_weight=2.0)
    return pool, snapshots, cache


def snap(cache, snapshots, ns, tokens, at):
    sid = snapshots.allocate()
    assert cache.attach_snapshot(ns, tokens, at, sid)
    return sid


def test_a_snapshot_hit_stops_at_the_deepest_snapshot_of_the_path():
    pool, snapshots, cache = make_snapshot_cache()
    tokens = list(range(16))
    table = write(pool, cache, A, tokens)
    found = cache.match(A, tokens, 15)
    assert (found.blocks, found.snapshot, found.path_blocks) == ([], None, 3)
    sid = snap(cache, snapshots, A, tokens, 8)
    found = cache.match(A, tokens, 15)
    assert (found.blocks, found.snapshot, found.path_blocks) == (table[:2], sid, 3)
    assert cache.match(B, tokens, 15).snapshot is None  # never another namespace's
    assert not cache.attach_snapshot(A, tokens, 8, 99)  # one per node
    assert not cache.attach_snapshot(A, [7] * 8, 8, 99)  # and only on a cached node


def test_snapshots_are_evicted_with_their_block_and_never_while_in_use():
    pool, snapshots, cache = make_snapshot_cache()
    tokens = list(range(8))
    table = write(pool, cache, A, tokens)
    snap(cache, snapshots, A, tokens, 8)
    assert not cache.evict_snapshot()  # its block is still held by the writer
    pool.free(table[::-1])
    assert cache.evict(2) == 2
    assert snapshots.num_free == 4 and cache.num_cached_snapshots == 0


def test_branch_points_keep_their_snapshots():
    pool, snapshots, cache = make_snapshot_cache()
    trunk = [1] * 8
    for tail in ([2] * 4, [3] * 4):  # two continuations of one trunk
        pool.free(write(pool, cache, A, trunk + tail)[::-1])
    snap(cache, snapshots, A, trunk, 8)  # the branch point: two children
    assert not cache.evict_snapshot()
    leaf = snap(cache, snapshots, A, trunk + [2] * 4, 12)
    assert cache.evict_snapshot() and snapshots.num_free == 3
    assert cache.match(A, trunk + [2] * 4 + [0], 13).snapshot != leaf


@pytest.mark.parametrize("eviction, survivor", [("lru", "short"), ("flop_aware", "long")])
def test_lru_evicts_the_oldest_and_flop_aware_keeps_the_costly(eviction, survivor):
    pool, snapshots, cache = make_snapshot_cache(eviction=eviction)
    long_, short = [1] * 16, [2] * 4
    for tokens in (long_, short):
        pool.free(write(pool, cache, A, tokens)[::-1])
    kept = {"long": snap(cache, snapshots, A, long_, 16),
            "short": snap(cache, snapshots, A, short, 4)}  # the newer one
    assert cache.evict_snapshot()
    assert cache.num_cached_snapshots == 1
    tokens = long_ if survivor == "long" else short
    assert cache.match(A, tokens + [0], len(tokens) + 1).snapshot == kept[survivor]
