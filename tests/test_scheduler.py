"""Scheduler policy as pure bookkeeping: budgets, chunking, FCFS, preemption, accounting."""

from __future__ import annotations

from heron.core.block_pool import BlockPool
from heron.core.config import EngineConfig
from heron.core.prefix_cache import Namespace, PrefixCache
from heron.core.sampling_params import SamplingParams
from heron.core.scheduler import Scheduler
from heron.core.sequence import Sequence, SequenceStatus


def make(num_blocks=100, **kw):
    cfg = EngineConfig(**{"block_size": 4, "max_num_batched_tokens": 16, **kw})
    pool = BlockPool(num_blocks)
    return Scheduler(cfg, pool), pool


def seq(i, n):
    return Sequence(i, f"r{i}", list(range(n)), SamplingParams(), i)


def advance(out):
    """Pretend the model ran: mark tokens computed and append a token where one is due."""
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        if item.seq.num_computed_tokens == len(item.seq.token_ids):
            item.seq.token_ids.append(0)


def test_prefill_is_chunked_under_the_budget_and_decodes_come_first():
    sched, _ = make()
    a, b = seq(0, 10), seq(1, 30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [(0, 10), (1, 6)]
    advance(out)
    out = sched.schedule()  # a decodes (1 token) before b's next chunk
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [(0, 1), (1, 15)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched, _ = make(chunked_prefill=False)
    a, b = seq(0, 10), seq(1, 10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert b.status is SequenceStatus.WAITING


def test_max_num_seqs_limits_running():
    sched, _ = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_by_recompute_frees_the_latest_arrival():
    sched, pool = make(num_blocks=6)
    a, b = seq(0, 8), seq(1, 8)  # 2 blocks each, 2 free afterwards
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())
    for _ in range(8):  # grow until the pool runs dry
        out = sched.schedule()
        if out.preempted:
            break
        advance(out)
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    assert pool.num_used_blocks == len(a.block_table)


def test_finish_returns_every_block():
    sched, pool = make()
    seqs = [seq(i, 9) for i in range(3)]
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())
    for s in seqs:
        sched.finish(s)
        sched.finish(s)  # idempotent
    assert pool.num_used_blocks == 0 and not sched.has_unfinished()


def test_a_failed_admission_releases_what_its_lookup_took():
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64)
    pool = BlockPool(6)
    cache = PrefixCache(pool, 4)
    sched = Scheduler(cfg, pool, cache)
    prefix = pool.allocate(2)
    cache.insert(Namespace(), list(range(8)), prefix, 8)
    pool.free(prefix)  # cached, unused
    hog = pool.allocate(4)
    s = seq(0, 20)  # its first 8 tokens are cached; it needs 3 more blocks than that
    sched.add(s)
    for _ in range(3):  # each retry looks up afresh: no reference piles up
        assert not sched.schedule().scheduled
        assert [pool.refcount(b) for b in prefix] == [1, 1]
        assert s.block_table == [] and s.num_computed_tokens == 0
    pool.free(hog)
    out = sched.schedule()
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [(s, 12)]
    assert s.block_table[:2] == prefix and s.num_cached_tokens == 8
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == (20, 8)
