"""Allocates the memory a family's `CacheSpec` asks for."""

from __future__ import annotations

import torch

from heron.core.cache_spec import CacheSpec, CacheTensors
from heron.core.config import EngineConfig


def num_kv_blocks_for(spec: CacheSpec, engine: EngineConfig, dtype: torch.dtype,
                      max_model_len: int) -> int:
    """``engine.num_kv_blocks`` when set, else as many blocks as ``kv_cache_memory_gb`` holds.

    A model without attention layers has zero-byte blocks (still the token bookkeeping of
    the scheduler and the prefix cache): then enough for every sequence at full length, twice.
    """
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    if spec.kv is None:
        return 0
    per_block = spec.kv.bytes_per_block(engine.block_size, dtype)
    if per_block == 0:
        return 2 * engine.max_num_seqs * -(-max_model_len // engine.block_size)
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


def allocate_lora(cache: CacheTensors, targets, num_slots: int, max_rank: int,
                  dtype: torch.dtype, device: torch.device) -> None:
    """Zeroed adapter slots for every `heron.core.lora.LoraTarget` (see ``CacheTensors.lora``)."""
    for t in targets:
        cache.lora[t.name] = (
            torch.zeros(t.num_layers, num_slots, max_rank, t.in_features, dtype=dtype,
                        device=device),
            torch.zeros(t.num_layers, num_slots, max_rank, t.out_features, dtype=dtype,
                        device=device))
    cache.lora_scaling = torch.zeros(num_slots, dtype=dtype, device=device)


def num_swap_blocks_for(spec: CacheSpec, engine: EngineConfig, dtype: torch.dtype) -> int:
    """``engine.num_swap_blocks`` when set, else as many blocks as ``swap_space_gb`` holds."""
    if engine.num_swap_blocks is not None:
        return engine.num_swap_blocks
    per_block = spec.kv.bytes_per_block(engine.block_size, dtype)
    return max(1, int(engine.swap_space_gb * 2**30) // max(per_block, 1))


def allocate_host_kv(device_kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A host-memory twin of ``device_kv`` with ``num_blocks`` blocks (pinned beside CUDA, so
    that swaps are plain DMA copies)."""
    shape = list(device_kv.shape)
    shape[2] = num_blocks
    return torch.zeros(shape, dtype=device_kv.dtype, pin_memory=device_kv.is_cuda)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks ``src[:, :, s]`` → ``dst[:, :, d]`` for each ``(s, d)`` in ``pairs``
    (``src`` and ``dst`` may be the same tensor, or live on different devices)."""
    if not pairs:
        return
    s_ids = torch.tensor([s for s, _ in pairs], device=src.device)
    d_ids = torch.tensor([d for _, d in pairs], device=dst.device)
    dst.index_copy_(2, d_ids, src.index_select(2, s_ids).to(dst.device))


def copy_block_rows(kv: torch.Tensor, copies: list[tuple[int, int, int]]) -> None:
    """Copy rows ``[:n)`` of block ``s`` to block ``d`` of ``kv`` for each ``(s, d, n)``: a
    fork's copy on write, where the rows past ``n`` are the child's to write. (Beams fork
    every step; copying only the filled rows halves what that moves on average.)"""
    by_rows: dict[int, list[tuple[int, int]]] = {}
    for s, d, n in copies:
        by_rows.setdefault(n, []).append((s, d))
    for n, pairs in by_rows.items():
        rows = kv[:, :, :, :n]
        copy_blocks(rows, rows, pairs)
