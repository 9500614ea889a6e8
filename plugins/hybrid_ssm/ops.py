"""The Mamba2 mixer's ops over a flat batch with states in engine slots: torch reference on
CPU (the ``*_ref`` functions, built on `heron.plugins.hybrid_ssm.mamba2`), the plugin's CuPy
kernels (`heron.plugins.hybrid_ssm.cuda`) when the tensors are on a CUDA device.

``seqs`` lists the prefilling sequences as ``(first row, end row, slot)``; the other rows of
the batch are left alone (what a prefill op returns for them is unspecified). States are
updated in place: ``conv_state [slots, C, K - 1]`` in the model dtype, ``ssm_state [slots,
H, P, N]`` in float32. A decode row whose slot is negative is padding (of a captured
graph's batch): it returns zeros and reads and writes no state.
"""

from __future__ import annotations

import torch

from heron.plugins.hybrid_ssm import mamba2


def conv1d_prefill_ref(x: torch.Tensor, seqs: list[tuple[int, int, int]],
                       conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """The causal conv + SiLU of each sequence's rows of ``x [T, C]``, continuing from its
    slot's window, which then holds the sequence's last inputs. Returns ``[T, C]``."""
    out = torch.empty_like(x)
    for first, end, slot in seqs:
        out[first:end], window = mamba2.causal_conv1d(x[first:end], conv_state[slot], weight,
                                                      bias)
        conv_state[slot].copy_(window)
    return out


def conv1d_decode_ref(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token per sequence: ``x [B, C]``, ``slots [B]``. Returns ``[B, C]``."""
    keep = slots >= 0
    if not keep.all():
        out = torch.zeros_like(x)
        if keep.any():
            out[keep] = conv1d_decode_ref(x[keep], conv_state, slots[keep], weight, bias)
        return out
    out, window = mamba2.causal_conv1d_step(x, conv_state.index_select(0, slots), weight, bias)
    conv_state.index_copy_(0, slots, window.to(conv_state.dtype))
    return out


def ssd_prefill_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                    seqs: list[tuple[int, int, int]], ssm_state: torch.Tensor) -> torch.Tensor:
    """The chunked SSD scan of each sequence's rows (``x [T, H, P]``, ``dt [T, H]`` float32,
    ``B, C [T, G, N]``; see `mamba2.ssd_chunk_scan`) from its slot's state, which then holds
    the state after its last row. Returns ``y [T, H, P]`` float32."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for first, end, slot in seqs:
        y[first:end], final = mamba2.ssd_chunk_scan(
            x[first:end], dt[first:end], A, B[first:end], C[first:end], D, chunk_size,
            ssm_state[slot])
        ssm_state[slot].copy_(final)
    return y


def ssm_decode_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """One recurrence step per sequence (``x [B, H, P]``, ``dt [B, H]``, ``B, C [B, G, N]``)
    on its slot's state. Returns ``y [B, H, P]`` float32."""
    keep = slots >= 0
    if not keep.all():
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if keep.any():
            y[keep] = ssm_decode_ref(x[keep], dt[keep], A, B[keep], C[keep], D, ssm_state,
                                     slots[keep])
        return y
    y, new = mamba2.ssm_step(ssm_state.index_select(0, slots), x, dt, A, B, C, D)
    ssm_state.index_copy_(0, slots, new)
    return y


gated_rms_norm_ref = mamba2.gated_rms_norm


def conv1d_prefill(x, seqs, conv_state, weight, bias):
    if x.is_cuda:
        from heron.plugins.hybrid_ssm import cuda
        return cuda.conv1d_prefill(x, seqs, conv_state, weight, bias)
    return conv1d_prefill_ref(x, seqs, conv_state, weight, bias)


def conv1d_decode(x, conv_state, slots, weight, bias):
    if x.is_cuda:
        from heron.plugins.hybrid_ssm import cuda
        return cuda.conv1d_decode(x, conv_state, slots, weight, bias)
    return conv1d_decode_ref(x, conv_state, slots, weight, bias)


def ssd_prefill(x, dt, A, B, C, D, chunk_size, seqs, ssm_state):
    if x.is_cuda:
        from heron.plugins.hybrid_ssm import cuda
        return cuda.ssd_prefill(x, dt, A, B, C, D, chunk_size, seqs, ssm_state)
    return ssd_prefill_ref(x, dt, A, B, C, D, chunk_size, seqs, ssm_state)


def ssm_decode(x, dt, A, B, C, D, ssm_state, slots):
    if x.is_cuda:
        from heron.plugins.hybrid_ssm import cuda
        return cuda.ssm_decode(x, dt, A, B, C, D, ssm_state, slots)
    return ssm_decode_ref(x, dt, A, B, C, D, ssm_state, slots)


def gated_rms_norm(y, z, weight, eps, group_size, norm_before_gate=False):
    if y.is_cuda:
        from heron.plugins.hybrid_ssm import cuda
        return cuda.gated_rms_norm(y, z, weight, eps, group_size, norm_before_gate)
    return gated_rms_norm_ref(y, z, weight, eps, group_size, norm_before_gate)
