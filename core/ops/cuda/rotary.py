"""CUDA `rotary` (kernels/rotary.cu): same contract as `heron.core.ops.rotary.rotary_ref`."""

from __future__ import annotations

import torch

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
    if k.dtype != q.dtype:
        raise TypeError(f"rotary: q is {q.dtype} but k is {k.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim > head_dim or rot_dim % 2:
        raise ValueError(f"rotary: rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    q, k = _heads_view(q), _heads_view(k)
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        pos = positions.to(device=q.device, dtype=torch.int64).contiguous()
        cs = cos_sin_cache.to(device=q.device, dtype=torch.float32).contiguous()
        items = (num_q_heads + num_kv_heads) * (head_dim - rot_dim // 2)
        launch("rotary.cu", "rotary_kernel", {"HERON_DTYPE": dtype_code(q.dtype)},
               (num_tokens, -(-items // _THREADS), 1), (_THREADS, 1, 1),
               (q_out, k_out, q, i64(q.stride(0)), i64(q.stride(1)), k, i64(k.stride(0)),
                i64(k.stride(1)), pos, cs, i32(num_q_heads), i32(num_kv_heads), i32(head_dim),
                i32(rot_dim)), device=q.device)
    return q_out, k_out
