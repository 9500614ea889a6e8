"""Gated activations: ``act(x[:, :d]) * x[:, d:]`` over a fused gate/up projection.

On the CPU, float32 and bfloat16 rows go to a compiled kernel (``kernels/activation_cpu.cpp``)
where one can be built: torch's four ops (two slices, silu, mul) cost more in dispatch than
in arithmetic on a decode step's single row, once a layer.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from heron.core import cpu_kernels


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _compiled_silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`silu_and_mul_ref` of float32 or bfloat16 CPU rows by the compiled kernel; None where
    it does not apply or is not built."""
    dtype = x.dtype
    if not ((dtype is torch.float32 or dtype is torch.bfloat16) and x.dim() == 2
            and x.stride(1) == 1 and x.shape[1] % 2 == 0):
        return None
    lib = _kernel(dtype)
    if lib is None:
        return None
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=dtype)
    lib.heron_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, d)
    return out


@functools.cache
def _kernel(dtype: torch.dtype, vec_floats: int | None = None):
    """The compiled SiLU-and-mul of ``dtype`` rows, its argument types set; None if not
    built. ``vec_floats`` (8, 16): built for vectors of that many floats, not the machine's."""
    lib = cpu_kernels.load("activation_cpu.cpp",
                           {"ACT_BF16": 1} if dtype == torch.bfloat16 else {}, vec_floats)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.heron_silu_and_mul.argtypes = [p, i64, p, i64, i64]
    lib.heron_silu_and_mul.restype = None
    return lib


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from heron.core.ops import cuda
        return cuda.silu_and_mul(x)
    if x.is_cpu and x.shape[0]:
        out = _compiled_silu_and_mul(x)
        if out is not None:
            return out
    return silu_and_mul_ref(x)
