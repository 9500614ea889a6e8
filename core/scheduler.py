"""Continuous batching: each step, a token budget's worth of decodes and prefill chunks.

Policy (FCFS): running sequences first, in arrival order, each taking its next chunk (one
token for a decode); then waiting sequences are admitted while the budget, the sequence
limit and free blocks allow. When blocks run out, the most recently arrived running
sequence is preempted by recompute: its blocks are freed and it goes back to the front of
the waiting queue with no computed tokens. Pure bookkeeping: no tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from heron.core.block_pool import BlockPool
from heron.core.config import EngineConfig
from heron.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed this step (the query length)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_pool: BlockPool) -> None:
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.chunked_prefill
        self.block_pool = block_pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        self.block_pool.free(seq.block_table)
        seq.block_table = []

    def _preempt_last(self, out: SchedulerOutput) -> Sequence:
        seq = self.running.pop()
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
        return seq

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens == 0:
                continue
            needed = self._blocks_needed(seq, num_tokens)
            while not self.block_pool.can_allocate(needed):
                if self._preempt_last(out) is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.block_table += self.block_pool.allocate(needed)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        if out.preempted:
            return out  # admitting now would only be preempted again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_tokens = seq.num_uncomputed_tokens
            if num_tokens > budget:
                if not self.chunked_prefill:
                    break
                num_tokens = budget
            needed = self._blocks_needed(seq, num_tokens)
            if not self.block_pool.can_allocate(needed):
                break
            self.waiting.popleft()
            seq.block_table += self.block_pool.allocate(needed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return out

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks. Idempotent."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
