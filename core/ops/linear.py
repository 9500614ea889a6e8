"""Dense projections ``y = x @ W.T + b`` whose weights are prepared once, at load.

On the CPU, torch's default fp32 GEMM (MKL) re-packs the weight on every call. With the few
rows of a decode step (1-64) that re-packing, not the math, sets the speed: SmolLM2's 30
layers of projections took about 85 ms per step at 32 rows through `F.linear` on 2 cores and
about 50 ms with the weights kept in oneDNN's blocked layout (its lm_head 26 ms and 11 ms),
the layout vLLM's CPU backend uses too. `pack_weight` converts a CPU weight to that layout:
fp32, and bf16 on CPUs with bf16 dot products (AVX512-BF16, AMX), where a packed bf16
projection reads half the bytes (a 4096 x 576 one at 1 row: 82 us fp32, 57 us bf16, 125 us
through `F.linear`). `linear` multiplies with either kind. On CUDA a weight keeps its
values and shape but may be laid out column-major (`CUDA_WEIGHT_LAYOUT`), which cuBLAS
multiplies with other kernels. Other devices and dtypes, and torch builds without oneDNN,
keep the plain weight and `F.linear`. A GGUF weight kept in its quantized blocks
(`KeptWeight`) is its own layout: `linear` multiplies it with `quantized_linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.core.ops.quantized import KeptWeight, quantized_linear

# The row count oneDNN tunes the packed layout for; any count works with it.
_PACK_ROWS = 32

#: How `pack_weight` lays out a 2-D CUDA weight ``[out, in]``: "row" (row-major, as loaded:
#: ``x @ W.T`` is cuBLAS's "TN" case) or "column" (column-major, the storage of ``W.T``:
#: "NN"). bench/gpu_bench.py's gemm section times both on the decode step's shapes.
CUDA_WEIGHT_LAYOUT = "row"


def can_pack(w: torch.Tensor) -> bool:
    if not (w.device.type == "cpu" and w.dim() == 2 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16
                                        and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(w: torch.Tensor | None) -> torch.Tensor | None:
    """``w [out, in]`` in the fastest layout for `linear` on its device (a new tensor when
    `can_pack` or laid out column-major on CUDA; ``w`` itself otherwise). A packed weight
    has ``shape`` but no strides: use it only through `linear`."""
    if w is not None and w.is_cuda and w.dim() == 2 and CUDA_WEIGHT_LAYOUT == "column":
        return w.t().contiguous().t()
    if w is None or isinstance(w, KeptWeight) or not can_pack(w):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)


def unpack_weight(w: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the values of a `pack_weight`-ed (or plain, or quantized) ``w``."""
    if isinstance(w, KeptWeight):
        return w.dequantize()
    return w.to_dense() if w.is_mkldnn else w


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           relu: bool = False) -> torch.Tensor:
    """``x [T, in] @ w.T + bias`` for a plain or `pack_weight`-ed ``w``, then ReLU with
    ``relu`` (fused into the GEMM of a packed weight: no second pass over a wide output).
    A weight of another dtype than ``x`` (a drafter's bf16 weights among fp32 activations)
    multiplies ``x`` cast to its dtype, and the result comes back in ``x``'s."""
    if isinstance(w, KeptWeight):
        y = quantized_linear(x, w, bias)
        return F.relu(y) if relu else y
    if w.dtype != x.dtype:
        return linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype),
                      relu).to(x.dtype)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "relu" if relu else "none",
                                                  [], "")
    y = F.linear(x, w, bias)
    return F.relu(y) if relu else y
