"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def rms_norm(x, weight, eps, residual=None):
    if x.is_cuda:
        from heron.core.ops import cuda
        return cuda.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
