"""Mamba2 (SSD) ops in plain torch: causal conv, chunked scan, one-step update, gated norm.

Shapes: ``T`` tokens of one sequence, ``B`` sequences (one token each) of a decode batch,
``C`` conv channels (``d_inner + 2 * n_groups * d_state``: x, then B, then C), ``K`` the
conv kernel width, ``H`` SSM heads of ``P`` channels, ``G`` groups sharing B/C, ``N`` the
state size. The SSM state is float32 whatever the model dtype. The math mirrors
transformers' pure-torch Mamba2 path (``torch_forward`` / ``mamba2_chunk_scan``), so its
results agree with it to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one sequence's ``x [T, C]``, continuing from
    ``conv_state [C, K - 1]`` (the inputs before ``x``; zeros at the start of a sequence).

    ``weight [C, K]``, ``bias [C]``. Returns ``(y [T, C], new_state [C, K - 1])``.
    """
    num_tokens = x.shape[0]
    seq = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    y = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])
    new_state = seq[:, seq.shape[1] - conv_state.shape[1]:]
    return F.silu(y[0, :, :num_tokens].t()), new_state


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x [B, C]``, ``conv_state [B, C, K - 1]``.

    Returns ``(y [B, C], new_state [B, C, K - 1])`` (SiLU applied).
    """
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return F.silu(y), window[:, :, 1:]


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j + 1 : i + 1])`` for ``j <= i``; ``-inf`` above."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    strict = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~strict, 0).cumsum(dim=-2)
    lower = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=0)
    return x.masked_fill(~lower, -torch.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                   initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence in chunks of ``chunk_size`` (chunk boundaries count from
    the first token of ``x``; any length works, the last chunk is zero-padded).

    ``x [T, H, P]``, ``dt [T, H]`` (already ``softplus(dt + dt_bias)`` and clamped, float32),
    ``A [H]`` (negative, float32), ``B, C [T, G, N]``, ``D [H]``, ``initial_state [H, P, N]``.
    Returns ``(y [T, H, P] float32, final_state [H, P, N] float32)``:
    ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``.
    """
    num_tokens, num_heads, _ = x.shape
    rep = num_heads // B.shape[1]
    x = x.float()
    B = B.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    C = C.float().repeat_interleave(rep, dim=1)
    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    skip = D.float()[:, None] * x
    x = x * dt[..., None]
    A = A.float() * dt  # [T, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [c, l, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)
    A = A.permute(2, 0, 1)  # [H, c, l]
    A_cumsum = A.cumsum(dim=-1)
    # within each chunk: attention-like, masked by the decay between positions
    L = torch.exp(_segment_sum(A))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * L.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    # each chunk's contribution to the state at its end
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [H, c, l]
    B_decay = B * decay_states.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", B_decay, x)
    # the recurrence over chunk boundaries, starting from the carried state
    states = torch.cat([initial_state[None].float(), states], dim=0)  # [c + 1, H, P, N]
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))  # [H, c+1, c+1]
    states = torch.einsum("zch,zhpn->chpn", decay_chunk.permute(2, 1, 0), states)
    states, final_state = states[:-1], states[-1]
    # each chunk's start state read out at every position of the chunk
    decay_out = torch.exp(A_cumsum).permute(1, 2, 0)[..., None]  # [c, l, H, 1]
    y_off = torch.einsum("clhn,chpn->clhp", C, states) * decay_out
    y = (y_diag + y_off).reshape(-1, num_heads, x.shape[-1])[:num_tokens] + skip
    return y, final_state


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step per sequence: ``state [B, H, P, N]`` float32, ``x [B, H, P]``,
    ``dt [B, H]`` (already ``softplus(dt + dt_bias)``, float32), ``A, D [H]``,
    ``B, C [B, G, N]``. Returns ``(y [B, H, P] float32, new_state [B, H, P, N])``."""
    batch, num_heads, head_dim = x.shape
    rep = num_heads // B.shape[1]
    x = x.float()
    B = B.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    C = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt * A.float())[..., None, None]
    dBx = (dt[..., None] * B)[:, :, None, :] * x[..., None]  # [B, H, P, N]
    new_state = state * dA + dBx
    y = torch.bmm(new_state.view(batch * num_heads, head_dim, -1),
                  C.reshape(batch * num_heads, -1, 1)).view(batch, num_heads, head_dim)
    return y + x * D.float()[:, None], new_state


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   group_size: int, norm_before_gate: bool = False) -> torch.Tensor:
    """The Mamba2 output gate and grouped RMSNorm over ``y, z [T, d_inner]`` (float32 math).

    ``norm_before_gate=False`` (Mamba2, Bamba, Granite, NemotronH, Falcon-H1 by default):
    ``norm(y * silu(z)) * weight``; True: ``norm(y) * weight * silu(z)``. ``weight`` None: no
    norm, only ``y * silu(z)`` (Falcon-H1 with ``mamba_rms_norm=False``). Each group of
    ``group_size`` channels is normalised on its own. Returns float32.
    """
    y, gate = y.float(), F.silu(z.float())
    if weight is None:
        return y * gate
    if not norm_before_gate:
        y = y * gate
    groups = y.view(*y.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    y = weight.float() * groups.view(y.shape)
    return y * gate if norm_before_gate else y
