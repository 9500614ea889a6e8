"""Per-sequence state slots (SSM conv/scan states) and the snapshots the prefix cache keeps.

The engine gives every running sequence of a family that declares states one slot: a row
of each ``cache.states[name]`` tensor, zeroed when the sequence starts from its first
token, or restored from a snapshot when the prefix cache found one. Snapshots are rows of
tensors shaped like the slots; the prefix cache owns the ones attached to its nodes, and a
running sequence may hold one *pending* snapshot: the state at the last block boundary it
reached, cached when it finishes (Marconi's "last decoded token" checkpoint, at the block
granularity of the KV it pairs with).
"""

from __future__ import annotations

import torch

from heron.core.cache_spec import CacheSpec, CacheTensors
from heron.core.prefix_cache import PrefixCache
from heron.core.sequence import Sequence
from heron.core.slot_pool import SlotPool


def snapshot_bytes(spec: CacheSpec, dtype: torch.dtype) -> int:
    """Bytes of one snapshot (one slot of every state)."""
    total = 0
    for state in spec.states:
        itemsize = torch.empty((), dtype=state.dtype or dtype).element_size()
        total += itemsize * int(torch.Size(state.shape).numel())
    return total


class StatePool:
    def __init__(self, cache: CacheTensors, spec: CacheSpec, num_slots: int,
                 num_snapshots: int) -> None:
        self.states = cache.states
        self._zero_fresh = [s.name for s in spec.states if s.zero_fresh]
        self.slots = SlotPool(num_slots)
        self.snapshot_pool = SlotPool(num_snapshots) if num_snapshots else None
        self.snapshots = {name: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype,
                                            device=t.device)
                          for name, t in self.states.items()} if num_snapshots else {}
        self.prefix_cache: PrefixCache | None = None  # set by the engine, in snapshot mode
        self._pending: dict[int, tuple[int, int]] = {}  # seq id -> (snapshot, position)
        self._before_drafts: dict[str, torch.Tensor] = {}  # slot -> state, while verifying
        self._holders: dict[int, int] = {}  # slot -> sequences sharing it, when over one

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def acquire(self, seq: Sequence) -> None:
        """Give ``seq`` a slot holding the state after no tokens."""
        if seq.state_slot is None:
            seq.state_slot = self.slots.allocate()
            for name in self._zero_fresh:
                self.states[name][seq.state_slot].zero_()

    def fork(self, parent: Sequence, child: Sequence, copy) -> None:
        """Give ``child`` a slot holding ``parent``'s state (a beam forked from it): a new
        one, copied by ``copy(parent_slot, child_slot)`` (the family's
        `ModelRunner.fork_state`), or, when ``copy`` is None, ``parent``'s own, shared until
        the last of its holders is released."""
        if copy is None:
            child.state_slot = parent.state_slot
            self._holders[parent.state_slot] = self._holders.get(parent.state_slot, 1) + 1
            return
        child.state_slot = self.slots.allocate()
        copy(parent.state_slot, child.state_slot)

    def restore(self, seq: Sequence, snapshot: int) -> None:
        for name, t in self.states.items():
            t[seq.state_slot].copy_(self.snapshots[name][snapshot])

    def save_before_drafts(self, seq: Sequence) -> None:
        """Keep ``seq``'s state aside before a step runs its drafts through it (one copy per
        slot, allocated the first time)."""
        if not self._before_drafts:
            self._before_drafts = {name: torch.empty_like(t) for name, t in self.states.items()}
        for name, t in self.states.items():
            self._before_drafts[name][seq.state_slot].copy_(t[seq.state_slot])

    def restore_before_drafts(self, seq: Sequence) -> None:
        """Put back the state `save_before_drafts` kept (a draft was rejected)."""
        for name, t in self.states.items():
            t[seq.state_slot].copy_(self._before_drafts[name][seq.state_slot])

    def checkpoint(self, seq: Sequence, kind: str) -> None:
        """Save the state after ``seq``'s computed tokens: ``"commit"`` attaches it to the
        prefix cache now, ``"pending"`` keeps it as the sequence's latest."""
        held = self._pending.pop(seq.seq_id, None)
        snapshot = held[0] if held is not None else self._take()
        if snapshot is None:
            return  # no room: a checkpoint is an optimisation, not a duty
        for name, t in self.snapshots.items():
            t[snapshot].copy_(self.states[name][seq.state_slot])
        if kind == "pending":
            self._pending[seq.seq_id] = (snapshot, seq.num_computed_tokens)
        else:
            self._attach(seq, snapshot, seq.num_computed_tokens)

    def release(self, seq: Sequence, *, commit: bool) -> None:
        """``seq`` stops running: free its slot; with ``commit``, cache its pending snapshot
        (its blocks must be in the prefix cache already), else drop it."""
        held = self._pending.pop(seq.seq_id, None)
        if held is not None:
            if commit:
                self._attach(seq, *held)
            else:
                self.snapshot_pool.free(held[0])
        slot = seq.state_slot
        if slot is not None:
            holders = self._holders.pop(slot, 1)
            if holders > 2:
                self._holders[slot] = holders - 1
            elif holders == 1:
                self.slots.free(slot)
            seq.state_slot = None

    def _take(self) -> int | None:
        pool = self.snapshot_pool
        if pool is None:
            return None
        if pool.num_free == 0 and not self.prefix_cache.evict_snapshot():
            return None
        return pool.allocate()

    def _attach(self, seq: Sequence, snapshot: int, position: int) -> None:
        if not self.prefix_cache.attach_snapshot(seq.namespace, seq.token_ids, position,
                                                 snapshot):
            self.snapshot_pool.free(snapshot)
