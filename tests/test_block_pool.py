"""Block pool invariants under random allocate / fork / free interleavings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heron.core.block_pool import BlockPool, BlockPoolError

NUM_BLOCKS = 12


def check_invariants(pool: BlockPool, owners: list[list[int]]) -> None:
    expected = [0] * NUM_BLOCKS
    for blocks in owners:
        for b in blocks:
            expected[b] += 1
    assert [pool.refcount(b) for b in range(NUM_BLOCKS)] == expected
    assert all(r >= 0 for r in expected)
    assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
    assert pool.num_used_blocks == sum(1 for r in expected if r > 0)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "fork", "free"]),
                         st.integers(0, NUM_BLOCKS + 2), st.integers(0, 100)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_interleavings_keep_invariants(program):
    pool = BlockPool(NUM_BLOCKS)
    owners: list[list[int]] = []  # each owner holds one ref on each of its blocks
    for op, n, pick in program:
        if op == "alloc":
            if pool.can_allocate(n):
                owners.append(pool.allocate(n))
            else:
                with pytest.raises(BlockPoolError):
                    pool.allocate(n)
        elif op == "fork" and owners:
            owners.append(pool.fork(owners[pick % len(owners)]))
        elif op == "free" and owners:
            pool.free(owners.pop(pick % len(owners)))
        check_invariants(pool, owners)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == NUM_BLOCKS


def test_double_free_and_fork_of_free_block_are_refused():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.fork(blocks)
    b = pool.allocate(1)
    with pytest.raises(BlockPoolError):
        pool.free(b + b)  # one ref cannot be dropped twice in one call
    assert pool.refcount(b[0]) == 1
