"""The Mamba2 mixer over a flat engine batch, with per-sequence states in engine slots.

Sequences with several rows this step (prefill chunks) run the chunked scan, starting from
the state in their slot; sequences with one row run the single-step update together. Either
way each slot ends holding the state after the sequence's last row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core.batch import Batch
from heron.core.ops import linear
from heron.plugins.hybrid_ssm.config import MambaConfig
from heron.plugins.hybrid_ssm.ops import (conv1d_decode, conv1d_prefill, gated_rms_norm,
                                          ssd_prefill, ssm_decode)


@dataclass
class MambaWeights:
    in_proj: torch.Tensor              # [d_inner (z) + conv_dim (x, B, C) + H (dt), hidden]
    in_proj_bias: torch.Tensor | None
    conv_weight: torch.Tensor          # [conv_dim, K]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor              # [H] float32
    A: torch.Tensor                    # [H] float32, -exp(A_log)
    D: torch.Tensor                    # [H] float32
    norm: torch.Tensor | None          # [d_inner]; None: gate only, no norm
    out_proj: torch.Tensor             # [hidden, d_inner]
    out_proj_bias: torch.Tensor | None


@dataclass
class MambaPlan:
    """How this batch's rows map onto the state slots; built once per step, shared by layers."""

    prefills: list[tuple[int, int, int]]  # (first row, end row, slot) of multi-row sequences
    decode_rows: torch.Tensor | None      # [Bd] rows of one-row sequences (unless all rows)
    decode_slots: torch.Tensor | None     # [Bd] their slots; None: no one-row sequence
    is_all_decode: bool                   # every row is a one-row sequence's, in order
    clamp_rows: torch.Tensor | None       # [T] bool: rows whose dt gets `dt_limit` (prompt
                                          # rows); None: none does

    @classmethod
    def build(cls, batch: Batch, clamps_dt: bool) -> MambaPlan:
        dev = batch.input_ids.device
        clamp = _prompt_rows(batch) if clamps_dt else None
        clamp_rows = torch.tensor(clamp, device=dev) if clamp else None
        if batch.attn.is_decode_only:
            # the batch's own device slots: no host list read, no copy (a captured graph's
            # static batch has none to read)
            return cls(prefills=[], decode_rows=None, decode_slots=batch.state_slots,
                       is_all_decode=True, clamp_rows=clamp_rows)
        prefills, decode_rows, decode_slots = [], [], []
        start = 0
        for q_len, slot in zip(batch.attn.query_lens_list, batch.state_slots_list):
            if q_len == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
            else:
                prefills.append((start, start + q_len, slot))
            start += q_len
        has_decode = bool(decode_rows)
        return cls(
            prefills=prefills,
            decode_rows=torch.tensor(decode_rows, device=dev) if has_decode else None,
            decode_slots=torch.tensor(decode_slots, device=dev) if has_decode else None,
            is_all_decode=False, clamp_rows=clamp_rows)


def _prompt_rows(batch: Batch) -> list[bool] | None:
    """Per row, whether it is a prompt token's (None when no row is)."""
    # NOTE: transformers clamps dt in its prefill pass (the scan) but not in its one-token
    # decode step; prompt rows get the clamp whatever way they run here
    clamp = []
    for seq, q_len, seq_len in zip(batch.seqs, batch.attn.query_lens_list,
                                   batch.attn.seq_lens_list):
        num_clamped = min(max(seq.num_prompt_tokens - (seq_len - q_len), 0), q_len)
        clamp += [True] * num_clamped + [False] * (q_len - num_clamped)
    return clamp if any(clamp) else None


def has_prompt_rows(batch: Batch) -> bool:
    """Whether some row of ``batch`` is a prompt token's (its dt is clamped: see `_dt`)."""
    return _prompt_rows(batch) is not None


def _dt(dt_raw: torch.Tensor, w: MambaWeights, cfg: MambaConfig,
        plan: MambaPlan) -> torch.Tensor:
    dt = F.softplus(dt_raw.float() + w.dt_bias)
    if plan.clamp_rows is not None:
        lo, hi = cfg.dt_limit
        dt = torch.where(plan.clamp_rows[:, None], dt.clamp(lo, hi), dt)
    return dt


def mamba_mixer(h: torch.Tensor, w: MambaWeights, cfg: MambaConfig, plan: MambaPlan,
                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One Mamba2 layer on ``h [T, hidden]``; reads and updates this layer's states in place:
    ``conv_state [num_slots, conv_dim, K - 1]``, ``ssm_state [num_slots, H, P, N]``.
    Returns ``[T, hidden]``."""
    num_tokens = h.shape[0]
    d_inner, num_heads, head_dim = cfg.d_inner, cfg.num_heads, cfg.head_dim
    gn = cfg.num_groups * cfg.state_size
    proj = linear(h, w.in_proj, w.in_proj_bias)
    z, xbc, dt_raw = proj.split([d_inner, cfg.conv_dim, num_heads], dim=-1)
    dt = _dt(dt_raw, w, cfg, plan)
    y = None
    if plan.prefills:
        x, B, C = conv1d_prefill(xbc, plan.prefills, conv_state, w.conv_weight,
                                 w.conv_bias).split([d_inner, gn, gn], dim=-1)
        y = ssd_prefill(x.view(num_tokens, num_heads, head_dim), dt, w.A,
                        B.view(num_tokens, cfg.num_groups, -1),
                        C.view(num_tokens, cfg.num_groups, -1), w.D, cfg.chunk_size,
                        plan.prefills, ssm_state)

    if plan.decode_slots is not None:
        rows, slots = plan.decode_rows, plan.decode_slots
        take = (lambda t: t) if plan.is_all_decode else (lambda t: t.index_select(0, rows))
        x, B, C = conv1d_decode(take(xbc), conv_state, slots, w.conv_weight,
                                w.conv_bias).split([d_inner, gn, gn], dim=-1)
        num = x.shape[0]
        y_dec = ssm_decode(x.reshape(num, num_heads, head_dim), take(dt), w.A,
                           B.reshape(num, cfg.num_groups, -1),
                           C.reshape(num, cfg.num_groups, -1), w.D, ssm_state, slots)
        if plan.is_all_decode:
            y = y_dec
        else:
            y.index_copy_(0, rows, y_dec)

    out = gated_rms_norm(y.view(num_tokens, d_inner), z, w.norm, cfg.norm_eps,
                         d_inner // cfg.num_groups, cfg.norm_before_gate)
    return linear(out.to(h.dtype), w.out_proj, w.out_proj_bias)
