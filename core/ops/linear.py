"""Dense projections ``y = x @ W.T + b`` whose weights are prepared once, at load.

On the CPU, torch's default fp32 GEMM (MKL) re-packs the weight on every call. With the few
rows of a decode step (1-64) that re-packing, not the math, sets the speed: SmolLM2's 30
layers of projections took about 85 ms per step at 32 rows through `F.linear` on 2 cores and
about 50 ms with the weights kept in oneDNN's blocked layout (its lm_head 26 ms and 11 ms),
the layout vLLM's CPU backend uses too. `pack_weight` converts an fp32 CPU weight to that layout;
`linear` multiplies with either kind. Other devices and dtypes, and torch builds without
oneDNN, keep the plain weight and `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN tunes the packed layout for; any count works with it.
_PACK_ROWS = 32


def can_pack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(w: torch.Tensor | None) -> torch.Tensor | None:
    """``w [out, in]`` in the fastest layout for `linear` on its device (a new tensor on the
    CPU in fp32; ``w`` itself otherwise). A packed weight has ``shape`` but no strides: use it
    only through `linear`."""
    if w is None or not can_pack(w):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)


def unpack_weight(w: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the values of a `pack_weight`-ed (or plain) ``w``."""
    return w.to_dense() if w.is_mkldnn else w


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ w.T + bias`` for a plain or `pack_weight`-ed ``w``."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)
