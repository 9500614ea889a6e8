"""The engine allocates what a family's CacheSpec declares, sized from config."""

from __future__ import annotations

import torch

from heron.core.cache_spec import CacheSpec, KVCacheSpec, StateSpec
from heron.core.config import EngineConfig
from heron.core.kv_cache import allocate_cache, num_kv_blocks_for


def test_kv_blocks_from_memory_budget_and_state_slots():
    spec = CacheSpec(kv=KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8),
                     states=(StateSpec("conv", (2, 5, 3)),
                             StateSpec("ssm", (4,), dtype=torch.float64)))
    engine = EngineConfig(block_size=4, kv_cache_memory_gb=1 / 1024)  # 1 MiB
    per_block = 2 * 2 * 4 * 3 * 8 * 4  # K and V, layers, tokens, heads, dim, fp32 bytes
    assert spec.kv.bytes_per_block(4, torch.float32) == per_block
    num_blocks = num_kv_blocks_for(spec, engine, torch.float32, 4096)
    assert num_blocks == 2**20 // per_block
    assert num_kv_blocks_for(spec, EngineConfig(num_kv_blocks=7), torch.float32, 4096) == 7
    cache = allocate_cache(spec, engine, num_blocks, 6, torch.float32, torch.device("cpu"))
    assert cache.kv.shape == (2, 2, num_blocks, 4, 3, 8)
    k, v = cache.layer_kv(1)
    assert k.shape == v.shape == (num_blocks, 4, 3, 8)
    assert cache.states["conv"].shape == (6, 2, 5, 3)
    assert cache.states["ssm"].dtype == torch.float64 and cache.states["ssm"].shape == (6, 4)
