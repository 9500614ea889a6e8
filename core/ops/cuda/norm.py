"""CUDA `rms_norm` (kernels/norm.cu): same contract as `heron.core.ops.norm.rms_norm_ref`."""

from __future__ import annotations

import torch

from heron.core.ops.cuda.launch import dtype_code, f32, i32, i64, launch, vec_elems, vec_rows


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``, or ``(norm(x) * weight, None)``.

    Returns new tensors shaped like ``x``; the inputs are not modified. ``weight`` (and
    ``residual``) are used in ``x``'s dtype.
    """
    hidden = x.shape[-1]
    x2 = _rows(x)
    num_rows = x2.shape[0]
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    w = weight.to(x.dtype).contiguous()
    r2 = _rows(residual.to(x.dtype)) if residual is not None else None
    res_out = torch.empty_like(out) if residual is not None else None
    if num_rows:
        # One 16-byte vector (or, unaligned, one element) per item, at most 1024 threads.
        width = vec_elems(x.dtype) if vec_rows(hidden, out, res_out, x2, r2, w) else 1
        threads = min(1024, 32 * -(-hidden // (32 * width)))
        items = -(-hidden // (threads * width))
        defines = {"HERON_DTYPE": dtype_code(x.dtype), "HERON_NORM_VEC": int(width > 1),
                   "HERON_NORM_ITEMS": items}
        launch("norm.cu", "rms_norm_kernel", defines, (num_rows, 1, 1), (threads, 1, 1),
               (out, res_out, x2, i64(x2.stride(0)), r2,
                i64(r2.stride(0) if r2 is not None else 0), w, i32(hidden), f32(eps)),
               device=x.device)
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)
