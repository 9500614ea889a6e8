"""GPT-2's activation: GELU with the tanh approximation (transformers' ``gelu_new``).

`gelu_tanh_ref` is the torch op, used on the CPU and as the oracle of the CUDA kernel
(kernels/gelu.cu) that `gelu_tanh` runs on CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from heron.core.ops import dtype_code, i64, launch_kernel

GELU_KERNEL = Path(__file__).resolve().parent / "kernels" / "gelu.cu"
_THREADS = 256


def gelu_tanh_ref(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, elementwise."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_cuda(x: torch.Tensor) -> torch.Tensor:
    """The kernel's `gelu_tanh_ref`, on a CUDA tensor (float32, float16 or bfloat16)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        launch_kernel(str(GELU_KERNEL), "gelu_tanh_kernel", {"HERON_DTYPE": dtype_code(x.dtype)},
                      (min(-(-n // _THREADS), 2 ** 31 - 1), 1, 1), (_THREADS, 1, 1),
                      (out, x, i64(n)), device=x.device)
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_cuda(x) if x.is_cuda else gelu_tanh_ref(x)
