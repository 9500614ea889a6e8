"""Kernel-vs-reference checks for the hybrid_ssm family's Mamba2 kernels, shared by the GPU
tests and their CPU-emulated twins (as `tests.gpu.cases` is for core's).

Each check runs the CUDA op (`heron.plugins.hybrid_ssm.cuda`, on whatever backend `launch`
routes to) with its outputs poisoned, and the ``*_ref`` op in float32 on copies of the same
inputs. The inputs are built as the mixer passes them: x, B and C are strided column views
of one projection, the batch's rows mix prefilling and other sequences, and the state pools
hold more slots than the batch uses, in shuffled order, each pool one layer's view of a
two-layer pool as the engine's are; slots the batch does not use must come out unchanged.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from heron.plugins.hybrid_ssm import cuda as mamba_cuda
from heron.plugins.hybrid_ssm import ops
from tests.gpu.cases import TOL, assert_close, poisoned_outputs


def _layout(seq_lens: list[int], seed: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """Prefilling sequences of ``seq_lens`` rows with a one-row sequence before each (rows
    the prefill ops must leave alone), in distinct shuffled slots of a larger pool:
    ``(seqs, num_rows, num_slots)``."""
    num_slots = 2 * len(seq_lens) + 3
    slots = random.Random(seed).sample(range(num_slots), len(seq_lens))
    seqs, row = [], 0
    for n, slot in zip(seq_lens, slots):
        row += 1
        seqs.append((row, row + n, slot))
        row += n
    return seqs, row, num_slots


def _rand(g, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def _rows_of(seqs) -> list[int]:
    return [r for first, end, _ in seqs for r in range(first, end)]


def _decode_slots(g, batch, num_slots, padded):
    """``batch`` distinct shuffled slots of ``num_slots``; with ``padded`` the last row's is
    -1, as a captured graph's padding rows are: ``(slots, used slots, padded rows)``."""
    slots = torch.randperm(num_slots, generator=g)[:batch]
    if padded:
        slots[-1] = -1
    keep = slots >= 0
    return slots, slots[keep].tolist(), (~keep).nonzero().flatten().tolist()


def _unused_unchanged(after, before, used, what):
    keep = [s for s in range(before.shape[0]) if s not in set(used)]
    assert torch.equal(after[keep].cpu(), before[keep].cpu()), f"{what}: unused slots changed"


def check_conv1d_prefill(device, dtype, seq_lens, channels, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, num_rows, num_slots = _layout(seq_lens, seed)
    proj = _rand(g, num_rows, channels + 24, dtype=dtype, device=device)
    x = proj[:, 8:8 + channels]  # a column view, as the mixer's xbc
    weight = _rand(g, channels, width, dtype=dtype, device=device, scale=0.5)
    bias = _rand(g, channels, dtype=dtype, device=device)
    state = _rand(g, num_slots, 2, channels, width - 1, dtype=dtype, device=device)[:, 1]
    ref_state = state.float().cpu().clone()  # a copy even when state is float32 on CPU
    ref = ops.conv1d_prefill_ref(x.float().cpu(), seqs, ref_state, weight.float().cpu(),
                                 bias.float().cpu())
    before = state.clone()
    with poisoned_outputs():
        out = mamba_cuda.conv1d_prefill(x, seqs, state, weight, bias)
    rows = _rows_of(seqs)
    assert_close(out[rows], ref[rows], dtype, "conv1d_prefill out")
    used = [slot for *_, slot in seqs]
    assert_close(state[used], ref_state[used], dtype, "conv1d_prefill window")
    _unused_unchanged(state, before, used, "conv1d_prefill")


def check_conv1d_decode(device, dtype, batch, channels, width, with_bias=True, padded=False,
                        seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = batch + 5
    slots, used, pads = _decode_slots(g, batch, num_slots, padded)
    x = _rand(g, batch, channels + 16, dtype=dtype, device=device)[:, 16:]
    weight = _rand(g, channels, width, dtype=dtype, device=device, scale=0.5)
    bias = _rand(g, channels, dtype=dtype, device=device) if with_bias else None
    state = _rand(g, num_slots, 2, channels, width - 1, dtype=dtype, device=device)[:, 1]
    ref_state = state.float().cpu().clone()  # a copy even when state is float32 on CPU
    ref = ops.conv1d_decode_ref(x.float().cpu(), ref_state, slots, weight.float().cpu(),
                                None if bias is None else bias.float().cpu())
    before = state.clone()
    with poisoned_outputs():
        out = mamba_cuda.conv1d_decode(x, state, slots.to(device), weight, bias)
    assert_close(out, ref, dtype, "conv1d_decode out")
    assert not out[pads].any(), "conv1d_decode: a padding row's output is not zero"
    assert_close(state[used], ref_state[used], dtype, "conv1d_decode window")
    _unused_unchanged(state, before, used, "conv1d_decode")


def _ssm_inputs(g, num_rows, heads, head_dim, groups, state_size, num_slots, dtype, device):
    """x [T, H, P], B, C [T, G, N] as views of one conv output; dt, A, D, states."""
    d_inner, gn = heads * head_dim, groups * state_size
    conv_out = _rand(g, num_rows, d_inner + 2 * gn, dtype=dtype, device=device)
    x, B, C = conv_out.split([d_inner, gn, gn], dim=-1)
    return dict(x=x.view(num_rows, heads, head_dim),
                dt=F.softplus(_rand(g, num_rows, heads) - 1).to(device),
                A=-torch.exp(_rand(g, heads) * 0.5).to(device),
                B=B.view(num_rows, groups, state_size), C=C.view(num_rows, groups, state_size),
                D=_rand(g, heads).to(device)), \
        _rand(g, num_slots, 2, heads, head_dim, state_size, device=device)[:, 1]


def _float_cpu(t: dict) -> dict:
    return {k: v.float().cpu() for k, v in t.items()}


def check_ssd_prefill(device, dtype, seq_lens, heads, head_dim, groups, state_size,
                      chunk_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, num_rows, num_slots = _layout(seq_lens, seed)
    t, state = _ssm_inputs(g, num_rows, heads, head_dim, groups, state_size, num_slots, dtype,
                           device)
    ref_state = state.cpu().clone()
    ref = ops.ssd_prefill_ref(**_float_cpu(t), chunk_size=chunk_size, seqs=seqs,
                              ssm_state=ref_state)
    before = state.clone()
    with poisoned_outputs():
        y = mamba_cuda.ssd_prefill(**t, chunk_size=chunk_size, seqs=seqs, ssm_state=state)
    rows, used = _rows_of(seqs), [slot for *_, slot in seqs]
    assert_close(y[rows], ref[rows], torch.float32, "ssd_prefill y")
    assert_close(state[used], ref_state[used], torch.float32, "ssd_prefill state")
    _unused_unchanged(state, before, used, "ssd_prefill")


def check_ssm_decode(device, dtype, batch, heads, head_dim, groups, state_size, padded=False,
                     seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = batch + 4
    slots, used, pads = _decode_slots(g, batch, num_slots, padded)
    t, state = _ssm_inputs(g, batch, heads, head_dim, groups, state_size, num_slots, dtype,
                           device)
    ref_state = state.cpu().clone()
    ref = ops.ssm_decode_ref(**_float_cpu(t), ssm_state=ref_state, slots=slots)
    before = state.clone()
    with poisoned_outputs():
        y = mamba_cuda.ssm_decode(**t, ssm_state=state, slots=slots.to(device))
    assert_close(y, ref, torch.float32, "ssm_decode y")
    assert not y[pads].any(), "ssm_decode: a padding row's output is not zero"
    assert_close(state[used], ref_state[used], torch.float32, "ssm_decode state")
    _unused_unchanged(state, before, used, "ssm_decode")


def check_gated_rms_norm(device, dtype, num_rows, d_inner, group_size, norm_before_gate,
                         with_weight=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = _rand(g, num_rows, d_inner, device=device)
    z = _rand(g, num_rows, 2 * d_inner, dtype=dtype, device=device)[:, d_inner:]
    weight = _rand(g, d_inner, dtype=dtype, device=device, scale=0.5) + 1 if with_weight else None
    ref = ops.gated_rms_norm_ref(y.cpu(), z.float().cpu(),
                                 None if weight is None else weight.float().cpu(), 1e-5,
                                 group_size, norm_before_gate)
    with poisoned_outputs():
        out = mamba_cuda.gated_rms_norm(y, z, weight, 1e-5, group_size, norm_before_gate)
    # float32 out, from inputs in ``dtype``: only summation order differs
    assert_close(out, ref, torch.float32, "gated_rms_norm")


__all__ = ["TOL", "check_conv1d_decode", "check_conv1d_prefill", "check_gated_rms_norm",
           "check_ssd_prefill", "check_ssm_decode"]
