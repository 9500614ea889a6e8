"""Fixed-size slots handed out by id: per-sequence states (SSM) and saved state snapshots.

Pure bookkeeping (no tensors): the engine owns the tensors whose rows the ids index.
"""

from __future__ import annotations


class SlotPoolError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise SlotPoolError(f"all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise SlotPoolError(f"slot {slot} is not in use")
        self._used[slot] = False
        self._free.append(slot)
