"""Scheduler policy as pure bookkeeping: budgets, chunking, FCFS, priorities, preemption,
accounting."""

from __future__ import annotations

from heron.core.adapter_pool import AdapterPool
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


def seq(i, n, priority=0):
    return Sequence(i, f"r{i}", list(range(n)), SamplingParams(priority=priority), i)


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


def test_without_chunked_prefill_a_prompt_past_the_budget_runs_alone():
    """An encoder's input longer than a whole budget waits for an empty step and runs
    there whole, alone; those behind it wait their turn (first come, first served)."""
    sched, _ = make(chunked_prefill=False)
    small, big, after = seq(0, 10), seq(1, 40), seq(2, 4)
    for s in (small, big, after):
        sched.add(s)
    for expected in ([(0, 10)], [(1, 40)], [(2, 4)]):
        out = sched.schedule()
        assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == expected
        for item in out.scheduled:  # pooled: each input finishes in its step
            sched.finish(item.seq)


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


def test_encoders_are_charged_per_stage_and_spread_over_steps():
    """budget 16, 4 encoder stages: a 40-token source's stage costs 10 tokens."""
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=16)
    sched = Scheduler(cfg, BlockPool(100), encoder_stages=4)

    def source_seq(i, length):
        return Sequence(i, f"r{i}", [2, 7], SamplingParams(), i,
                        encoder_token_ids=tuple(range(length)))

    def step():
        out = sched.schedule()
        for item in out.scheduled:
            item.seq.encoder_stages_done += item.encoder_stages
        advance(out)
        return [(s.seq.seq_id, s.encoder_stages, s.num_tokens) for s in out.scheduled]

    short, long, late = source_seq(0, 8), source_seq(1, 40), source_seq(2, 12)
    for s in (short, long, late):
        sched.add(s)
    # short: 4 stages cost 8, then its 2 decoder tokens; long: one stage (10) does not fit
    # the 6 left, so it waits, and so does everything behind it (FCFS)
    assert step() == [(0, 4, 2)]
    # long is admitted with one stage (10 of the 15 left); late's first stage (3) fits
    assert step() == [(0, 0, 1), (1, 1, 0), (2, 1, 0)]
    # running encoders progress every step, decodes first: 16 - 1 = 15 → long takes one
    # stage (10), late one stage (3 of the 5 left)
    assert step() == [(0, 0, 1), (1, 1, 0), (2, 1, 0)]
    # a running encoder runs a stage even when the budget is spent
    sched.max_num_batched_tokens = 11
    assert step() == [(0, 0, 1), (1, 1, 0), (2, 1, 0)]
    sched.max_num_batched_tokens = 16
    # long's last stage (10) and its decoder prompt (2); late's last stage takes the last
    # 3, its decoder tokens wait a step
    assert step() == [(0, 0, 1), (1, 1, 2), (2, 1, 0)]
    assert step() == [(0, 0, 1), (1, 0, 1), (2, 0, 2)]
    assert (long.encoder_stages_done, late.encoder_stages_done) == (4, 4)


def test_a_preempted_encoder_decoder_sequence_encodes_again():
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg, BlockPool(1), encoder_stages=2)
    a = Sequence(0, "r0", [2, 7], SamplingParams(), 0, encoder_token_ids=(5, 6, 7))
    b = Sequence(1, "r1", [2, 7], SamplingParams(), 1, encoder_token_ids=(5, 6))
    sched.add(a)
    out = sched.schedule()
    assert [(s.encoder_stages, s.num_tokens) for s in out.scheduled] == [(2, 2)]
    a.encoder_stages_done = 2
    advance(out)
    sched.add(b)
    a.token_ids += [1, 1, 1]  # its block is full: the next token needs a second block
    out = sched.schedule()
    assert out.preempted == [a] and a.encoder_stages_done == 0 and a.num_computed_tokens == 0


def scheduled(out):
    return [(s.seq.seq_id, s.num_tokens) for s in out.scheduled]


def test_priority_ranks_before_arrival():
    sched, _ = make(max_num_seqs=1, scheduling_policy="priority")
    for i, priority in enumerate([1, 0, -1, 0]):
        sched.add(seq(i, 2, priority))
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        [item] = out.scheduled
        order.append(item.seq.seq_id)
        sched.finish(item.seq)
    assert order == [2, 1, 3, 0]


def test_a_better_priority_takes_the_seat_of_the_worst_running():
    sched, _ = make(max_num_seqs=2, scheduling_policy="priority")
    a, b, c, d = seq(0, 2, 0), seq(1, 2, 1), seq(2, 2, 1), seq(3, 2, -1)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())
    sched.add(c)  # no better than b: it waits for a seat
    out = sched.schedule()
    assert scheduled(out) == [(0, 1), (1, 1)] and not out.preempted
    advance(out)
    sched.add(d)
    out = sched.schedule()
    assert out.preempted == [b] and scheduled(out) == [(0, 1), (3, 2)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.waiting == [b, c]  # rank order: the same priority, b arrived first


def test_a_better_priority_takes_the_blocks_of_worse_ones():
    sched, pool = make(num_blocks=4, scheduling_policy="priority")
    low = [seq(0, 8, 2), seq(1, 4, 1)]  # 3 blocks held once decoding
    for s in low:
        sched.add(s)
    advance(sched.schedule())
    high = seq(2, 8, 0)  # needs 2 blocks; 1 is free
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [low[0]] and (2, 8) in scheduled(out)
    assert low[1].status is SequenceStatus.RUNNING


def test_worse_prefill_chunks_leave_the_budget_to_a_better_waiting_sequence():
    sched, _ = make(scheduling_policy="priority")
    short, long = seq(0, 3, 1), seq(1, 40, 1)
    sched.add(short)
    sched.add(long)
    assert scheduled(sched.schedule()) == [(0, 3), (1, 13)]
    short.token_ids.append(0)
    short.num_computed_tokens, long.num_computed_tokens = 3, 13
    high = seq(2, 20, 0)
    sched.add(high)
    out = sched.schedule()  # short decodes; long's next chunk waits; high gets the rest
    assert scheduled(out) == [(0, 1), (2, 15)] and not out.preempted
    advance(out)
    assert scheduled(sched.schedule()) == [(2, 5), (0, 1), (1, 10)]


def test_fcfs_never_preempts_for_a_newcomer():
    sched, _ = make(max_num_seqs=1)
    a, b = seq(0, 2), seq(1, 2)
    sched.add(a)
    advance(sched.schedule())
    sched.add(b)
    out = sched.schedule()
    assert scheduled(out) == [(0, 1)] and not out.preempted and sched.waiting == [b]


def test_a_better_priority_waiting_for_an_adapter_slot_gets_one():
    """The one adapter slot is held by a worse request still in its prefill: it is
    preempted (a stalled prefill would never free the slot), and the better one runs."""
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=16, scheduling_policy="priority")
    sched = Scheduler(cfg, BlockPool(100), adapter_pool=AdapterPool(1))
    low = Sequence(0, "r0", list(range(40)), SamplingParams(priority=1), 0, Namespace("a"))
    high = Sequence(1, "r1", list(range(8)), SamplingParams(priority=0), 1, Namespace("b"))
    sched.add(low)
    advance(sched.schedule())  # low's first chunk: it holds the slot, mid-prefill
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [low] and scheduled(out) == [(1, 8)]
    assert out.adapter_loads == [("b", 0)]
