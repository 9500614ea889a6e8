"""CUDA `silu_and_mul` (kernels/activation.cu): same contract as its ``*_ref``."""

from __future__ import annotations

import torch

from heron.core.ops.cuda.launch import dtype_code, i32, i64, launch, vec_elems, vec_rows

_THREADS = 256


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``, as a new ``[..., I]`` tensor."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows and inter:
        width = vec_elems(x.dtype) if vec_rows(inter, out, x2) else 1
        defines = {"HERON_DTYPE": dtype_code(x.dtype), "HERON_ACT_VEC": int(width > 1)}
        launch("activation.cu", "silu_and_mul_kernel", defines,
               (num_rows, -(-inter // (_THREADS * width)), 1), (_THREADS, 1, 1),
               (out, x2, i64(x2.stride(0)), i32(inter)), device=x.device)
    return out.view(*x.shape[:-1], inter)
