"""CUDA Mamba2 ops (kernels/*.cu): the contracts of the ``*_ref`` ops of the same names in
`heron.plugins.hybrid_ssm.ops`, launched through core's `launch_kernel`."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from heron.core.ops import dtype_code, f32, i32, i64, launch_kernel, packed_rows

KERNELS = Path(__file__).resolve().parent / "kernels"
CONV, SSM, NORM = (str(KERNELS / name) for name in ("conv1d.cu", "ssm.cu", "gated_norm.cu"))
MAX_CONV_WIDTH = 8      # conv1d.cu
PREFILL_TOKENS = 64     # conv1d.cu: a sequence's tokens per block of the prefill conv
SCAN_ROWS = 16          # ssm.cu: a chunk's rows per block of the scan
MAX_HEAD_DIM = 256      # ssm.cu: SCAN_ROWS * P outputs over a block's 256 threads, 16 each
_CHANNELS = 128         # threads per block of the conv kernels


def _same_dtype(x: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} is {t.dtype}; the kernel wants the input's {x.dtype}")


def _slots(slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.int64).contiguous()


def _slot_stride(states: torch.Tensor) -> np.int64:
    """The stride between slots of a state pool whose slots are each packed (one layer's
    view of the engine's ``[slots, layers, ...]`` pool is)."""
    if not states[0].is_contiguous():
        raise ValueError("each slot of a state pool must be contiguous")
    return i64(states.stride(0))


# Every Mamba layer of a step passes the same prefilling sequences: their device tables are
# built (one host-to-device copy each) by the first layer and reused by the others.
@functools.lru_cache(maxsize=8)
def _seq_table(seqs: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(seqs, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=8)
def _chunk_tables(seqs: tuple, chunk_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chunks [NC, 3] (sequence, first row, length), seq_chunks [S + 1], NC)``: each
    sequence's rows in chunks of ``chunk_size``, counted from its first row."""
    chunks, seq_chunks = [], [0]
    for s, (first, end, _) in enumerate(seqs):
        chunks += [(s, row, min(chunk_size, end - row)) for row in range(first, end, chunk_size)]
        seq_chunks.append(len(chunks))
    return (torch.tensor(chunks, dtype=torch.int64, device=device),
            torch.tensor(seq_chunks, dtype=torch.int64, device=device), len(chunks))


def _conv(x, conv_state, weight, bias):
    """The conv kernels' common arguments: ``(x, x_stride, weight, bias)``, and the output."""
    if weight.shape[1] > MAX_CONV_WIDTH:
        raise ValueError(f"conv width {weight.shape[1]}: the kernels take {MAX_CONV_WIDTH}")
    _same_dtype(x, conv_state=conv_state, weight=weight, bias=bias)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x, x_stride = packed_rows(x)
    return (x, i64(x_stride), weight.contiguous(),
            None if bias is None else bias.contiguous()), out


def conv1d_decode(x, conv_state, slots, weight, bias):
    batch, channels = x.shape
    (x, x_stride, weight, bias), out = _conv(x, conv_state, weight, bias)
    if batch:
        launch_kernel(CONV, "conv1d_decode_kernel", {"HERON_DTYPE": dtype_code(x.dtype)},
                      (batch, -(-channels // _CHANNELS), 1), (_CHANNELS, 1, 1),
                      (out, x, x_stride, conv_state, _slot_stride(conv_state), _slots(slots),
                       weight, bias, i32(channels), i32(weight.shape[1])),
                      device=x.device)
    return out


def conv1d_prefill(x, seqs, conv_state, weight, bias):
    channels = x.shape[1]
    (x, x_stride, weight, bias), out = _conv(x, conv_state, weight, bias)
    if not seqs:
        return out
    table = _seq_table(tuple(seqs), x.device)
    longest = max(end - first for first, end, _ in seqs)
    defines = {"HERON_DTYPE": dtype_code(x.dtype)}
    blocks, width, slot_stride = -(-channels // _CHANNELS), i32(weight.shape[1]), \
        _slot_stride(conv_state)
    launch_kernel(CONV, "conv1d_prefill_kernel", defines,
                  (blocks, len(seqs), -(-longest // PREFILL_TOKENS)), (_CHANNELS, 1, 1),
                  (out, i64(channels), x, x_stride, conv_state, slot_stride, table, weight,
                   bias, i32(channels), width),
                  device=x.device)
    launch_kernel(CONV, "conv1d_window_kernel", defines, (blocks, len(seqs), 1),
                  (_CHANNELS, 1, 1),
                  (conv_state, slot_stride, x, x_stride, table, i32(channels), width),
                  device=x.device)
    return out


def _ssm_args(x, B, C):
    x, x_stride = packed_rows(x)
    B, bc_stride = packed_rows(B)
    C, c_stride = packed_rows(C)
    if c_stride != bc_stride:
        C, c_stride = C.contiguous(), C[0].numel()
        B, bc_stride = B.contiguous(), c_stride
    return x, i64(x_stride), B, C, i64(bc_stride)


def ssm_decode(x, dt, A, B, C, D, ssm_state, slots):
    batch, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    assert ssm_state.dtype == torch.float32
    _same_dtype(x, B=B, C=C)
    y = torch.empty((batch, num_heads, head_dim), dtype=torch.float32, device=x.device)
    if batch:
        x, x_stride, B, C, bc_stride = _ssm_args(x, B, C)
        launch_kernel(SSM, "ssm_decode_kernel", {"HERON_DTYPE": dtype_code(x.dtype)},
                      (batch, num_heads, 1), (128, 1, 1),
                      (y, ssm_state, _slot_stride(ssm_state), _slots(slots), x, x_stride,
                       dt.float().contiguous(),
                       A.float().contiguous(), D.float().contiguous(), B, C, bc_stride,
                       i32(num_heads), i32(head_dim), i32(num_groups), i32(state_size)),
                      device=x.device)
    return y


def ssd_prefill(x, dt, A, B, C, D, chunk_size, seqs, ssm_state):
    num_rows, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim}: the scan kernel takes {MAX_HEAD_DIM}")
    assert ssm_state.dtype == torch.float32
    _same_dtype(x, B=B, C=C)
    y = torch.empty((num_rows, num_heads, head_dim), dtype=torch.float32, device=x.device)
    if not seqs:
        return y
    dev, seqs = x.device, tuple(seqs)
    chunk_table, seq_chunks, num_chunks = _chunk_tables(seqs, chunk_size, dev)
    seq_table = _seq_table(seqs, dev)
    states = torch.empty((num_chunks, num_heads, head_dim, state_size), dtype=torch.float32,
                         device=dev)
    acum = torch.empty((num_chunks, num_heads, chunk_size), dtype=torch.float32, device=dev)
    x, x_stride, B, C, bc_stride = _ssm_args(x, B, C)
    dt, A, D = dt.float().contiguous(), A.float().contiguous(), D.float().contiguous()
    defines = {"HERON_DTYPE": dtype_code(x.dtype)}
    shape = (i32(num_heads), i32(head_dim), i32(num_groups), i32(state_size), i32(chunk_size))
    launch_kernel(SSM, "ssd_chunk_state_kernel", defines, (num_chunks, num_heads, 1),
                  (256, 1, 1), (states, acum, chunk_table, x, x_stride, dt, A, B, bc_stride,
                                *shape),
                  device=dev, shared_mem=2 * chunk_size * 4)
    launch_kernel(SSM, "ssd_state_passing_kernel", defines, (len(seqs), num_heads, 1),
                  (256, 1, 1), (states, ssm_state, _slot_stride(ssm_state), acum, chunk_table,
                                seq_table, seq_chunks,
                                i32(num_heads), i32(head_dim), i32(state_size),
                                i32(chunk_size)),
                  device=dev)
    floats = SCAN_ROWS * (2 * state_size + head_dim + SCAN_ROWS) + chunk_size
    launch_kernel(SSM, "ssd_chunk_scan_kernel", defines,
                  (num_chunks, num_heads, -(-chunk_size // SCAN_ROWS)), (256, 1, 1),
                  (y, states, acum, chunk_table, x, x_stride, dt, D, B, C, bc_stride, *shape),
                  device=dev, shared_mem=4 * floats)
    return y


def gated_rms_norm(y, z, weight, eps, group_size, norm_before_gate=False):
    num_rows, d_inner = y.shape
    y = y.float().contiguous()
    z, z_stride = packed_rows(z)
    if weight is not None:
        weight = weight.to(z.dtype).contiguous()
    out = torch.empty((num_rows, d_inner), dtype=torch.float32, device=y.device)
    if num_rows:
        threads = min(1024, 32 * max(1, -(-group_size // 128)))
        launch_kernel(NORM, "gated_rms_norm_kernel", {"HERON_DTYPE": dtype_code(z.dtype)},
                      (num_rows, d_inner // group_size, 1), (threads, 1, 1),
                      (out, y, z, i64(z_stride), weight, i32(d_inner), i32(group_size),
                       i32(int(norm_before_gate)), f32(eps)),
                      device=y.device)
    return out
