"""The engine's LoRA adapters: the loaded ones by name, and their weights in the slots.

`AdapterPool` decides which adapters are resident (bookkeeping); this class loads adapter
files, names each load with a fresh key (the key the prefix cache and the pool see), and
copies an adapter's weights into the slot the scheduler gave it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from heron.core.adapter_pool import AdapterPool
from heron.core.config import LoraConfig
from heron.core.kv_cache import CacheTensors, allocate_lora
from heron.core.lora import AdapterBusyError, AdapterError, AdapterWeights, LoraTarget

Loader = Callable[[str, str, list[LoraTarget], int], AdapterWeights]


class Adapters:
    def __init__(self, config: LoraConfig, targets: list[LoraTarget], cache: CacheTensors,
                 load: Loader | None, dtype: torch.dtype, device: torch.device) -> None:
        allocate_lora(cache, targets, config.max_loras, config.max_rank, dtype, device)
        self.pool = AdapterPool(config.max_loras)
        self.by_name: dict[str, AdapterWeights] = {}
        self._config, self._targets, self._cache, self._load = config, targets, cache, load
        self._keys: dict[str, str] = {}  # name -> key of its namespace and slot
        self._by_key: dict[str, AdapterWeights] = {}
        self._loads = itertools.count()

    def key(self, name: str) -> str:
        """The key of adapter ``name``'s current load; ValueError when none is loaded."""
        key = self._keys.get(name)
        if key is None:
            raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(self.by_name)}")
        return key

    def add(self, name: str, path: str) -> AdapterWeights:
        if name in self.by_name:
            raise AdapterError(f"adapter {name!r} is already loaded")
        if self._load is None:
            raise AdapterError(f"adapter {name!r}: no plugin reads PEFT adapters")
        weights = self._load(name, path, self._targets, self._config.max_rank)
        # NOTE: a fresh key per load: a reloaded adapter never meets its predecessor's KV
        key = f"{name}@{next(self._loads)}"
        self.by_name[name], self._keys[name], self._by_key[key] = weights, key, weights
        return weights

    def remove(self, name: str, users: int) -> None:
        """Unload ``name`` (KeyError when unknown), which ``users`` requests still use."""
        key = self._keys[name]
        if users:
            raise AdapterBusyError(f"adapter {name!r} is in use by {users} request(s)")
        self.pool.forget(key)
        del self.by_name[name], self._keys[name], self._by_key[key]

    def load_slot(self, key: str, slot: int) -> None:
        """Copy the adapter of ``key`` into ``slot``; the rows past its rank, and the
        projections it leaves alone, are zeroed."""
        weights = self._by_key[key]
        for target, (a, b) in self._cache.lora.items():
            a[:, slot].zero_()
            b[:, slot].zero_()
            for i, pair in enumerate(weights.layers.get(target) or ()):
                if pair is not None:
                    rank = pair[0].shape[0]
                    a[i, slot, :rank].copy_(pair[0])
                    b[i, slot, :rank].copy_(pair[1].T)
        self._cache.lora_scaling[slot] = weights.scaling
