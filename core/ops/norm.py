"""RMSNorm with an optional fused residual add.

On the CPU, float32 and bfloat16 rows go to a compiled kernel (``kernels/norm_cpu.cpp``)
where one can be built: torch's seven ops per norm cost more in dispatch than in arithmetic on
a decode step's few rows (a SmolLM2-135M decode step of one sequence spent 1.2 of its 17.5 ms
in them), and on a long prompt's rows its float32 path took 20 times the kernel's time.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from heron.core import cpu_kernels


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(x + residual) * weight, x + residual)``; without residual, ``(norm(x) * weight, None)``.

    Accumulates in float32 and returns the input dtype, as transformers' LlamaRMSNorm does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps), residual  # one op, same math
    xf = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * xf.to(x.dtype), residual


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, n]`` with contiguous rows, without a copy; None if it is not one."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    return t.view(-1, t.shape[-1]) if t.is_contiguous() else None


def _compiled_rms_norm(x, weight, eps, residual):
    """`rms_norm_ref` of float32 or bfloat16 CPU tensors by the compiled kernel; None where it
    does not apply or is not built."""
    # a decode step calls this twice a layer: the checks are as few torch calls as they can be
    dtype, shape = x.dtype, x.shape
    if not (dtype is weight.dtype and (dtype is torch.float32 or dtype is torch.bfloat16)
            and weight.dim() == 1 and weight.shape[0] == shape[-1] and weight.is_contiguous()
            and (residual is None or (residual.dtype is dtype and residual.shape == shape))):
        return None
    rows, res_rows = _rows(x), None if residual is None else _rows(residual)
    lib = _norm_kernel(dtype)
    if rows is None or (residual is not None and res_rows is None) or lib is None:
        return None
    out = torch.empty(shape, dtype=dtype)
    if residual is None:
        lib.heron_rms_norm(rows.data_ptr(), rows.stride(0), None, 0, weight.data_ptr(),
                           out.data_ptr(), None, rows.shape[0], rows.shape[1], eps)
        return out, None
    summed = torch.empty(shape, dtype=dtype)
    lib.heron_rms_norm(rows.data_ptr(), rows.stride(0), res_rows.data_ptr(), res_rows.stride(0),
                       weight.data_ptr(), out.data_ptr(), summed.data_ptr(), rows.shape[0],
                       rows.shape[1], eps)
    return out, summed


@functools.cache
def _norm_kernel(dtype: torch.dtype, vec_floats: int | None = None):
    """The compiled RMSNorm of ``dtype`` rows, its argument types set; None if not built.
    ``vec_floats`` (8, 16): built for vectors of that many floats, not the machine's."""
    lib = cpu_kernels.load("norm_cpu.cpp", {"ACT_BF16": 1} if dtype == torch.bfloat16 else {},
                           vec_floats)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.heron_rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i64, ctypes.c_float]
    lib.heron_rms_norm.restype = None
    return lib


def rms_norm(x, weight, eps, residual=None):
    if x.is_cuda:
        from heron.core.ops import cuda
        return cuda.rms_norm(x, weight, eps, residual)
    if x.is_cpu and x.numel():
        out = _compiled_rms_norm(x, weight, eps, residual)
        if out is not None:
            return out
    return rms_norm_ref(x, weight, eps, residual)
