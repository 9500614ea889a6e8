"""CUDA `rotary` and `rotary_write_kv` (kernels/rotary.cu): same contracts as their ``*_ref``."""

from __future__ import annotations

import torch

from heron.core.ops.cuda.cache import cache_strides, write_kv
from heron.core.ops.cuda.launch import dtype_code, i32, i64, launch

_THREADS = 128


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    # The kernel reads through token and head strides; only the last dim must be contiguous.
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]``; returns new contiguous tensors.

    ``q`` and ``k`` may be strided views (of a fused qkv projection). ``cos_sin_cache`` is
    ``[max_pos, rot_dim]`` (cos then sin), ``rot_dim <= D``; dims past ``rot_dim`` are copied.
    """
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _rotate(q, k, positions, cos_sin_cache, k_out, None), k_out


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """`rotary` of ``q`` and ``k``, then `write_kv` of the rotated ``k`` and ``v``, in one
    launch; returns the rotated ``q``. ``v [T, Hkv, D]`` may be a strided view too."""
    if k_cache.dtype != q.dtype:  # the fused kernel stores in q's dtype
        q, k = rotary(q, k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    if v.dtype != q.dtype:
        raise TypeError(f"rotary_write_kv: q is {q.dtype} but v is {v.dtype}")
    v = _heads_view(v)
    stride_block, stride_token, stride_head = cache_strides(k_cache, v_cache)
    slots = slot_mapping.to(device=q.device, dtype=torch.int64).contiguous()
    cache_args = (k_cache, v_cache, i64(stride_block), i64(stride_token), i64(stride_head),
                  i32(k_cache.shape[1]), slots, v, i64(v.stride(0)), i64(v.stride(1)))
    return _rotate(q, k, positions, cos_sin_cache, None, cache_args)


def _rotate(q, k, positions, cos_sin_cache, k_out, cache_args) -> torch.Tensor:
    """Launch rotary_kernel: ``k`` to ``k_out``, or with ``cache_args`` (the kernel's cache
    parameters) to the cache with ``v``. Returns the rotated ``q``."""
    if k.dtype != q.dtype:
        raise TypeError(f"rotary: q is {q.dtype} but k is {k.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim > head_dim or rot_dim % 2:
        raise ValueError(f"rotary: rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    q, k = _heads_view(q), _heads_view(k)
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens:
        pos = positions.to(device=q.device, dtype=torch.int64).contiguous()
        cs = cos_sin_cache.to(device=q.device, dtype=torch.float32).contiguous()
        items = (num_q_heads + num_kv_heads) * (head_dim - rot_dim // 2)
        if cache_args is None:
            cache_args = (None, None, i64(0), i64(0), i64(0), i32(1), None, None, i64(0), i64(0))
        else:
            items += num_kv_heads * head_dim  # v's copy
        launch("rotary.cu", "rotary_kernel", {"HERON_DTYPE": dtype_code(q.dtype)},
               (num_tokens, -(-items // _THREADS), 1), (_THREADS, 1, 1),
               (q_out, k_out, q, i64(q.stride(0)), i64(q.stride(1)), k, i64(k.stride(0)),
                i64(k.stride(1)), pos, cs, i32(num_q_heads), i32(num_kv_heads), i32(head_dim),
                i32(rot_dim), *cache_args), device=q.device)
    return q_out
