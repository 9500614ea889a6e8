"""Gated activations: ``act(x[:, :d]) * x[:, d:]`` over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from heron.core.ops import cuda
        return cuda.silu_and_mul(x)
    return silu_and_mul_ref(x)
