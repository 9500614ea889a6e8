"""LoRA adapter slots: which adapters are resident in the engine's stacked adapter weights.

Pure bookkeeping (no tensors). An adapter is made resident on demand (`acquire` says when
its weights must be copied into the slot); each running sequence holds one reference on its
adapter. When no slot is free, the least recently released unreferenced adapter is evicted;
an adapter with references is never evicted, so a request that finds every slot referenced
waits.
"""

from __future__ import annotations


class AdapterPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self._refs: dict[str, int] = {}
        self._unreferenced: dict[str, None] = {}  # insertion-ordered: least recent first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_referenced(self) -> int:
        return sum(1 for n in self._refs.values() if n)

    def refcount(self, key: str) -> int:
        return self._refs.get(key, 0)

    def can_acquire(self, key: str) -> bool:
        """Whether `acquire` would give ``key`` a slot now."""
        return key in self._slot_of or bool(self._free or self._unreferenced)

    def acquire(self, key: str) -> tuple[int, bool] | None:
        """A reference on adapter ``key``'s slot: ``(slot, needs_load)``, or None when every
        slot is held by referenced adapters."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._unreferenced.pop(key, None)
            self._refs[key] += 1
            return slot, False
        if self._free:
            slot = self._free.pop()
        elif self._unreferenced:
            victim = next(iter(self._unreferenced))
            del self._unreferenced[victim], self._refs[victim]
            slot = self._slot_of.pop(victim)
        else:
            return None
        self._slot_of[key], self._refs[key] = slot, 1
        return slot, True

    def release(self, key: str) -> None:
        if self._refs.get(key, 0) <= 0:
            raise RuntimeError(f"adapter {key!r} released more often than acquired")
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self._unreferenced[key] = None

    def forget(self, key: str) -> None:
        """Drop an unreferenced adapter from its slot (it is being unloaded)."""
        if self._refs.get(key, 0):
            raise RuntimeError(f"adapter {key!r} is in use")
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._unreferenced[key], self._refs[key]
            self._free.append(slot)
