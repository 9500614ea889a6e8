"""CUDA multi-LoRA (kernels/lora.cu): `heron.core.ops.lora.add_lora`'s contract, with its
segments and scaling given per row (see `heron.core.ops.lora.layer_loras`)."""

from __future__ import annotations

import torch

from heron.core.ops.cuda.launch import dtype_code, i32, i64, launch, packed_rows

_THREADS = 128


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  row_slots: torch.Tensor, row_scales: torch.Tensor) -> None:
    """``out[r] += row_scales[r] * (x[r] @ a[s].T) @ b[s]`` with ``s = row_slots[r]``; rows
    with ``s < 0`` are left alone. ``out`` may be a column slice of a fused projection."""
    num_rows, rank = x.shape[0], a.shape[1]
    if not num_rows:
        return
    if out.stride(-1) != 1:
        raise ValueError("add_lora writes rows of `out` in place: its last dim must be dense")
    x, x_stride = packed_rows(x)
    a, b = a.to(x.dtype).contiguous(), b.to(x.dtype).contiguous()
    defines = {"HERON_DTYPE": dtype_code(x.dtype)}
    v = torch.empty((num_rows, rank), dtype=torch.float32, device=x.device)
    warps = _THREADS // 32
    launch("lora.cu", "lora_shrink_kernel", defines, (num_rows, -(-rank // warps), 1),
           (_THREADS, 1, 1), (v, x, i64(x_stride), a, row_slots, row_scales, i32(rank),
                              i32(x.shape[1])), device=x.device)
    launch("lora.cu", "lora_expand_kernel", defines,
           (num_rows, -(-out.shape[1] // _THREADS), 1), (_THREADS, 1, 1),
           (out, i64(out.stride(0)), v, b, row_slots, i32(rank), i32(out.shape[1])),
           device=x.device)
