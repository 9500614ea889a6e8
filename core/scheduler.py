"""Continuous batching: each step, a token budget's worth of decodes and prefill chunks.

Policy: sequences are ranked by priority (``SamplingParams.priority``, lower first; always
0 under ``scheduling_policy = "fcfs"``), then by arrival. Running sequences go first, best
ranked first, each taking its next chunk (one token for a decode); then swapped-out
sequences are brought back, then waiting sequences are admitted, in rank order, while the
budget, the sequence limit and the blocks allow. An admitted sequence starts after the
longest prefix the prefix cache holds for it.

A waiting (or swapped) sequence of a better priority than running ones does not wait for
them: at the start of a step, running sequences of a worse priority are preempted (the
worst first) while it has no seat, adapter slot or blocks for its next chunk, and once it
has them they run no prefill chunk in that step, which leaves it the budget.

Beam search (``num_beams > 1``) runs a request's beams as a gang: admitting it reserves a
seat for every beam (its forks never wait for one), and preempting one of its sequences
preempts them all, so the oldest requests always hold complete gangs and progress.

An encoder-decoder's sequence first runs its encoder, in stages (`ModelRunner.encode`): a
stage over a source of S tokens costs S / ``encoder_stages`` tokens of the budget, so a long
source's encoder spreads over steps and never stalls running decodes for a whole encoder.
A sequence is admitted when its next stage fits the budget left (or the step is empty, or
one stage is larger than a whole budget); once admitted, it runs at least one stage every
step (the budget may be exceeded by that stage), so decodes that take the budget first
cannot starve it. Its decoder rows may join the step that runs its last stage.

Without chunked prefill a prompt computes whole; one larger than a whole budget (an
encoder's input: decoders' prompts are refused there, `heron.core.limits`) runs alone in an
otherwise empty step.

Speculative drafts (`heron.core.speculative`) ride with their sequence's pending token in
one chunk; they are cut to the budget, and dropped rather than preempt anyone for blocks.

When blocks run out (free blocks plus cached blocks nobody uses), the worst ranked running
sequence is preempted: with ``preemption = "swap"`` its blocks are copied to the host pool
(``SchedulerOutput.swap_out``) and it waits in the swapped queue with its progress kept;
otherwise, or when the host pool is full, by recompute: it goes back to the waiting queue,
in rank order, with no computed tokens (its written blocks stay in the prefix cache, so the
recompute is mostly a cache hit). Pure bookkeeping: no tensors.

With state snapshots (families with recurrent state), a hit also restores the state
(``SchedulerOutput.restores``), and prefill chunks end where the engine must checkpoint a
state (`checkpoint_due`): under ``marconi`` admission, the point where the prompt leaves
the cached tree (a branch point: the next prompt with this prefix hits there) and the
prompt's last block boundary (later boundaries are reached by decode; the last one reached
is cached when the sequence finishes); under ``every_block``, every block boundary.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field

from heron.core.adapter_pool import AdapterPool
from heron.core.block_pool import BlockPool
from heron.core.config import EngineConfig
from heron.core.prefix_cache import Match, PrefixCache
from heron.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed this step (the query length)
    encoder_stages: int = 0  # encoder stages run this step, before its tokens (if any)


@dataclass
class SchedulerOutput:
    """One step's plan. The engine copies ``swap_out`` pairs (device block, host block), then
    ``swap_in`` pairs (host block, device block), before it runs the batch."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, snapshot id)
    adapter_loads: list[tuple[str, int]] = field(default_factory=list)  # (adapter, slot)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def _rank(seq: Sequence) -> tuple[int, int, int]:
    return seq.params.priority, seq.arrival, seq.seq_id


class Scheduler:
    def __init__(self, config: EngineConfig, block_pool: BlockPool,
                 prefix_cache: PrefixCache | None = None,
                 host_pool: BlockPool | None = None,
                 snapshot_admission: str = "marconi", *, cache_generated: bool = True,
                 adapter_pool: AdapterPool | None = None, encoder_stages: int = 0) -> None:
        """``cache_generated``: whether generated tokens' KV and states may be cached (False
        for a family that computes them differently from prompt tokens). ``encoder_stages``:
        the stages of an encoder-decoder's encoder (0: the model has no encoder)."""
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.chunked_prefill
        self.block_pool = block_pool
        self.prefix_cache = prefix_cache
        self.host_pool = host_pool  # set: preempt by swap while it has room
        self.snapshots = prefix_cache is not None and prefix_cache.snapshots is not None
        self.snapshot_admission = snapshot_admission
        self.cache_generated = cache_generated
        self.adapter_pool = adapter_pool
        self.encoder_stages = encoder_stages
        self._splits: dict[int, dict[int, bool]] = {}  # seq id -> {position: commit?}
        # each queue in rank order: the first is the next to run, the last running the
        # next victim
        self.waiting: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV was reused

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    # -- blocks ------------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _can_allocate(self, num_blocks: int) -> bool:
        pool = self.block_pool
        return num_blocks <= pool.num_free_blocks + pool.num_evictable_blocks

    def _allocate(self, num_blocks: int) -> list[int]:
        short = num_blocks - self.block_pool.num_free_blocks
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.block_pool.allocate(num_blocks)

    def _release(self, seq: Sequence) -> None:
        self.block_pool.free(seq.block_table[::-1])  # tail first: see prefix_cache
        seq.block_table = []

    def _acquire_adapter(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give ``seq`` its adapter's slot (loaded this step if need be); False: no slot."""
        adapter = seq.namespace.adapter
        if not adapter or seq.lora_slot is not None:
            return True
        got = self.adapter_pool.acquire(adapter)
        if got is None:
            return False
        seq.lora_slot, needs_load = got
        if needs_load:
            out.adapter_loads.append((adapter, seq.lora_slot))
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.adapter_pool.release(seq.namespace.adapter)
            seq.lora_slot = None

    def _cacheable(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` may enter the prefix cache."""
        if self.cache_generated:
            return seq.num_computed_tokens
        return min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the whole blocks of ``seq``'s written KV to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq.namespace, seq.token_ids, seq.block_table,
                                     self._cacheable(seq))

    def _match(self, seq: Sequence) -> Match | None:
        """Start a sequence being admitted after its longest cached prefix; None when it
        may not use the cache (its prompt logprobs need every prompt position computed)."""
        if self.prefix_cache is None or seq.params.prompt_logprobs is not None:
            return None
        # at least one token must run, to give the logits of the next
        found = self.prefix_cache.match(seq.namespace, seq.token_ids, len(seq.token_ids) - 1)
        seq.block_table = found.blocks
        seq.num_computed_tokens = len(found.blocks) * self.block_size
        return found

    # -- state checkpoints -------------------------------------------------------------------

    def _plan_checkpoints(self, seq: Sequence, found: Match | None) -> None:
        bs, start = self.block_size, seq.num_computed_tokens
        last = len(seq.token_ids) // bs * bs
        if self.snapshot_admission == "every_block":
            splits = dict.fromkeys(range(start + bs, last + 1, bs), True)
        else:
            splits = {last: False} if last > start else {}
            branch = found.path_blocks * bs if found is not None else 0
            if branch > start:
                splits[branch] = True
        if splits:
            self._splits[seq.seq_id] = splits

    def _chunk(self, seq: Sequence, num_tokens: int) -> int:
        """``num_tokens`` cut short at the sequence's next planned checkpoint."""
        splits = self._splits.get(seq.seq_id)
        if splits:
            start = seq.num_computed_tokens
            ahead = [p - start for p in splits if start < p < start + num_tokens]
            num_tokens = min(ahead, default=num_tokens)
        return num_tokens

    def checkpoint_due(self, seq: Sequence) -> str | None:
        """After a step: ``"commit"`` when the state after ``seq``'s computed tokens should
        be cached now, ``"pending"`` when it should be kept as the sequence's latest (cached
        when it finishes), else None."""
        pos = seq.num_computed_tokens
        if not self.snapshots or pos % self.block_size or pos > self._cacheable(seq):
            return None
        planned = self._splits.get(seq.seq_id, {}).pop(pos, None)
        if planned is None:
            planned = self.snapshot_admission == "every_block"
        return "commit" if planned else "pending"

    # -- encoders ----------------------------------------------------------------------------

    def _encoder_left(self, seq: Sequence) -> int:
        return self.encoder_stages - seq.encoder_stages_done if self.encoder_stages else 0

    def _encoder_plan(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """``(stages, cost)``: the encoder stages of ``seq`` to run this step within
        ``budget`` tokens, and their cost; at least one stage for a running sequence, in an
        empty step, or when one stage would never fit a budget."""
        left = self._encoder_left(seq)
        if not left:
            return 0, 0
        length, total = len(seq.encoder_token_ids), self.encoder_stages
        stages = min(left, budget * total // length)
        limit = self.max_num_batched_tokens
        if stages == 0 and (seq.status is SequenceStatus.RUNNING or budget == limit
                            or -(-length // total) > limit):
            stages = 1
        return stages, min(budget, -(-length * stages // total))

    def _decoder_tokens(self, seq: Sequence, stages: int, budget: int) -> int:
        """Decoder tokens of ``seq`` to run after ``stages`` encoder stages: none until its
        encoder is done, then its next chunk (whole without chunked prefill)."""
        if stages < self._encoder_left(seq):
            return 0
        num_tokens = seq.num_uncomputed_tokens + len(seq.draft_token_ids)
        if num_tokens > budget:
            chunkable = self.chunked_prefill or seq.status is SequenceStatus.RUNNING
            num_tokens = budget if chunkable else 0
        return num_tokens

    # -- speculative drafts ------------------------------------------------------------------

    def _fit_drafts(self, seq: Sequence, num_tokens: int) -> int:
        """Cut ``seq``'s drafts to the ``num_tokens`` the budget gave it, or drop them when
        the blocks they need are not free (a guess never preempts anyone)."""
        real = min(num_tokens, seq.num_uncomputed_tokens)
        keep = num_tokens - real
        if keep and not self._can_allocate(self._blocks_needed(seq, num_tokens)):
            keep = 0
        del seq.draft_token_ids[keep:]
        return real + keep

    def rollback(self, seq: Sequence) -> None:
        """After verification moved ``num_computed_tokens`` back over rejected drafts: free
        the blocks past the ones ``seq``'s tokens need (only rejected drafts wrote there)."""
        keep = -(-len(seq.token_ids) // self.block_size)
        extra = seq.block_table[keep:]
        if extra:
            self.block_pool.free(extra[::-1])
            del seq.block_table[keep:]

    # -- preemption --------------------------------------------------------------------------

    # -- seats -------------------------------------------------------------------------------

    def _seats_used(self) -> int:
        """Running sequences, counting each beam-search request as its ``num_beams``."""
        gangs, plain = {}, 0
        for s in self.running:
            if s.params.num_beams > 1:
                gangs[s.request_id] = s.params.num_beams
            else:
                plain += 1
        return plain + sum(gangs.values())

    def _has_seat(self, seq: Sequence) -> bool:
        if seq.params.num_beams > 1 and any(s.request_id == seq.request_id
                                            for s in self.running):
            return True  # its request's gang holds a seat for it
        return self._seats_used() + seq.params.num_beams <= self.max_num_seqs

    def _preempt_last(self, out: SchedulerOutput) -> Sequence:
        seq = self._preempt(self.running.pop(), out)
        if seq.params.num_beams > 1:  # the whole gang: a partial one could only wait
            for other in [s for s in self.running if s.request_id == seq.request_id]:
                self.running.remove(other)
                self._preempt(other, out)
        return seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> Sequence:
        self._splits.pop(seq.seq_id, None)
        seq.draft_token_ids = []
        self.cache_computed(seq)
        host = self.host_pool
        if host is not None and host.can_allocate(len(seq.block_table)):
            seq.host_block_table = host.allocate(len(seq.block_table))
            out.swap_out += zip(seq.block_table, seq.host_block_table)
            self._release(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_rank)
        else:
            self._release(seq)
            self._release_adapter(seq)
            seq.num_computed_tokens = seq.encoder_stages_done = 0  # the engine frees its slot
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=_rank)
        out.preempted.append(seq)
        self.num_preemptions += 1
        return seq

    # -- the step ----------------------------------------------------------------------------

    def schedule(self, hold: Collection[int] = ()) -> SchedulerOutput:
        """The next step's plan. Running sequences whose ids are in ``hold`` sit it out (the
        engine knows they end when their token in flight lands)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._make_room(out)
        made_room = len(out.preempted)
        # the priority below which prefill chunks wait: that of the next to come in, when it
        # outranks a running sequence and can come in
        head, better = self._next_in(), None
        if (head is not None and self.running
                and head.params.priority < self.running[-1].params.priority
                and self._admissible(head)):
            better = head.params.priority
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in hold:
                continue  # (not running: preempted earlier in this loop)
            if (better is not None and better < seq.params.priority
                    and seq.num_uncomputed_tokens > 1):
                continue  # a prefill chunk: the budget goes to the better sequence
            if budget == 0 and not self._encoder_left(seq):
                if not self.encoder_stages:
                    break  # nothing else runs without budget
                continue  # running encoders still take a stage
            stages, cost = self._encoder_plan(seq, budget)
            num_tokens = self._chunk(seq, self._decoder_tokens(seq, stages, budget - cost))
            if seq.draft_token_ids:
                num_tokens = self._fit_drafts(seq, num_tokens)
            if num_tokens == 0 and stages == 0:
                continue
            needed = self._blocks_needed(seq, num_tokens)
            while not self._can_allocate(needed) and seq.status is SequenceStatus.RUNNING:
                self._preempt_last(out)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if needed:  # most decodes fit the last block
                seq.block_table += self._allocate(needed)
            out.scheduled.append(ScheduledSeq(seq, num_tokens, stages))
            budget -= cost + num_tokens
        if len(out.preempted) > made_room:
            return out  # bringing others in now would only preempt again
        budget = self._swap_in(out, budget)
        if self.swapped and (not self.waiting or _rank(self.swapped[0]) < _rank(self.waiting[0])):
            return out  # the swapped rank before anything waiting
        self._admit(out, budget)
        return out

    def _next_in(self) -> Sequence | None:
        """The sequence to bring in next: the best ranked swapped or waiting one."""
        return min((q[0] for q in (self.swapped, self.waiting) if q), key=_rank, default=None)

    def _admissible(self, seq: Sequence) -> bool:
        """Whether ``seq`` (swapped or waiting) finds a seat, its adapter's slot and the
        blocks of its next chunk now."""
        adapter = seq.namespace.adapter
        if adapter and seq.lora_slot is None and not self.adapter_pool.can_acquire(adapter):
            return False
        chunk = min(seq.num_uncomputed_tokens, self.max_num_batched_tokens)
        return self._has_seat(seq) and self._can_allocate(self._blocks_needed(seq, chunk))

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt running sequences of a worse priority than the next to come in while it
        is not admissible."""
        while self.running and (head := self._next_in()) is not None:
            if head.params.priority >= self.running[-1].params.priority or self._admissible(head):
                return
            self._preempt_last(out)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and self._has_seat(self.swapped[0]):
            seq = self.swapped[0]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            needed = self._blocks_needed(seq, num_tokens)
            if not self._can_allocate(needed):
                break
            self.swapped.pop(0)
            seq.block_table = self._allocate(needed)
            out.swap_in += zip(seq.host_block_table, seq.block_table)
            # NOTE: safe to free before the copy: no step both swaps out and swaps in
            self.host_pool.free(seq.host_block_table)
            seq.host_block_table = []
            self._run(seq, num_tokens, out)
            budget -= num_tokens
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self._has_seat(self.waiting[0]):
            seq = self.waiting[0]
            if not self._acquire_adapter(seq, out):
                break  # every adapter slot is in use: wait for one
            found = self._match(seq)
            stages, cost = self._encoder_plan(seq, budget)
            num_tokens = seq.num_uncomputed_tokens
            if self._encoder_left(seq):
                num_tokens = self._decoder_tokens(seq, stages, budget - cost)
            elif num_tokens > budget and self.chunked_prefill:
                num_tokens = budget
            needed = self._blocks_needed(seq, num_tokens)
            # a whole prompt past the budget runs alone in an otherwise empty step
            alone = not self.chunked_prefill and not out.scheduled
            if (num_tokens + cost > budget and not alone or not self._can_allocate(needed)
                    or self._encoder_left(seq) and not stages):
                self._release(seq)  # what the lookup took (the retry looks up afresh)
                self._release_adapter(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            cached = seq.num_computed_tokens
            if found is not None:
                self.prefix_queried_tokens += len(seq.token_ids)
                self.prefix_hit_tokens += cached
                if found.snapshot is not None:
                    out.restores.append((seq, found.snapshot))
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            if self.snapshots:
                self._plan_checkpoints(seq, found)
                num_tokens = self._chunk(seq, num_tokens)
                needed = self._blocks_needed(seq, num_tokens)
            seq.block_table += self._allocate(needed)
            self._run(seq, num_tokens, out, stages)
            budget -= cost + num_tokens

    def _run(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
             encoder_stages: int = 0) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_rank)
        out.scheduled.append(ScheduledSeq(seq, num_tokens, encoder_stages))

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int, int] | None:
        """Give ``child`` (a sibling of ``parent`` with the same prompt, not yet scheduled)
        ``parent``'s computed KV: whole blocks shared, the partly filled last block copied
        (the child will write its own tokens there). Returns the copy the engine must make
        now, as (source block, destination block, rows filled), or None.

        Without a free seat or block, the child waits to be computed from scratch instead
        (mostly a prefix-cache hit).
        """
        computed = parent.num_computed_tokens
        whole, partial = divmod(computed, self.block_size)
        if not self._has_seat(child) or not self._can_allocate(int(partial > 0)):
            child.num_cached_tokens = 0
            self.add(child)
            return None
        self._acquire_adapter(child, SchedulerOutput())  # resident: the parent holds it
        child.block_table = self.block_pool.fork(parent.block_table[:whole])
        copy = None
        if partial:
            copy = (parent.block_table[whole], self._allocate(1)[0], partial)
            child.block_table.append(copy[1])
        child.num_computed_tokens = computed
        child.encoder_stages_done = parent.encoder_stages_done
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_rank)
        return copy

    def finish(self, seq: Sequence, *, cache: bool = True) -> None:
        """Remove a finished or aborted sequence and free its blocks. Idempotent.

        With ``cache``, its written blocks are offered to the prefix cache first (not for a
        sequence whose last step failed)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._splits.pop(seq.seq_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.host_pool.free(seq.host_block_table)
            seq.host_block_table = []
        elif seq in self.waiting:  # a sibling never scheduled is in no queue
            self.waiting.remove(seq)
        if cache and seq.block_table:
            self.cache_computed(seq)
        self._release(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.FINISHED
