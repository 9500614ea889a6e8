"""Allocates the memory a family's `CacheSpec` asks for."""

from __future__ import annotations

import torch

from heron.core.cache_spec import CacheSpec, CacheTensors
from heron.core.config import EngineConfig


def num_kv_blocks_for(spec: CacheSpec, engine: EngineConfig, dtype: torch.dtype) -> int:
    """``engine.num_kv_blocks`` when set, else as many blocks as ``kv_cache_memory_gb`` holds."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    if spec.kv is None:
        return 0
    per_block = spec.kv.bytes_per_block(engine.block_size, dtype)
    return max(1, int(engine.kv_cache_memory_gb * 2**30) // per_block)


def allocate_cache(spec: CacheSpec, engine: EngineConfig, num_blocks: int, num_slots: int,
                   dtype: torch.dtype, device: torch.device) -> CacheTensors:
    cache = CacheTensors(block_size=engine.block_size)
    if spec.kv is not None:
        kv = spec.kv
        cache.kv = torch.zeros(kv.num_layers, 2, num_blocks, engine.block_size,
                               kv.num_kv_heads, kv.head_dim, dtype=dtype, device=device)
    for state in spec.states:
        cache.states[state.name] = torch.zeros(num_slots, *state.shape,
                                               dtype=state.dtype or dtype, device=device)
    return cache
