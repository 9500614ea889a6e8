"""CUDA `write_kv` (kernels/cache.cu): same contract as `heron.core.ops.attention.write_kv_ref`."""

from __future__ import annotations

import torch

from heron.core.ops.cuda.launch import dtype_code, i32, i64, launch

_THREADS = 256


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, token, head) strides in elements, shared by both caches (views of one pool)."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError("k_cache and v_cache must have the same dtype")
    if k_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at flat slots ``slot_mapping [T]``, in place.

    Slots are ``block * block_size + offset``; a negative slot is skipped (padded rows).
    ``k`` and ``v`` may be strided views; they are converted to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if not num_tokens:
        return
    stride_block, stride_token, stride_head = cache_strides(k_cache, v_cache)
    k = k.to(k_cache.dtype)
    v = v.to(k_cache.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slots = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    launch("cache.cu", "write_kv_kernel", {"HERON_DTYPE": dtype_code(k_cache.dtype)},
           (num_tokens, 1, 1), (_THREADS, 1, 1),
           (k_cache, v_cache, i64(stride_block), i64(stride_token), i64(stride_head),
            k, i64(k.stride(0)), i64(k.stride(1)), v, i64(v.stride(0)), i64(v.stride(1)),
            slots, i32(num_kv_heads), i32(head_dim), i32(k_cache.shape[1])), device=k.device)
