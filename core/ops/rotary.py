"""Rotary position embeddings (neox / rotate-half layout, as HF Llama uses)."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(rot_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies for ``rot_dim`` rotated dims, with optional rope scaling.

    Supported ``scaling["rope_type"]``: ``default``, ``linear``, ``llama3``.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).double() / rot_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def rope_cos_sin_cache(rot_dim: int, max_positions: int, base: float,
                       scaling: dict | None = None) -> torch.Tensor:
    """``[max_positions, rot_dim]`` float32: cos of each frequency, then sin."""
    inv_freq = rope_inv_freq(rot_dim, base, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by their positions; returns new tensors.

    The first ``rot`` dims (the cache's width) of each head rotate as (x1, x2) halves:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``, computed in float32; the rest pass through.
    q and k go through together: per layer, the op count is what costs on the CPU.
    """
    num_q = q.shape[1]
    cs = cos_sin_cache.index_select(0, positions)[:, None, :]  # [T, 1, rot]
    half = cs.shape[-1] // 2
    cos, sin = cs[..., :half], cs[..., half:]
    x = torch.cat([q, k], dim=1)
    xf = x[..., :2 * half].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if 2 * half != x.shape[-1]:
        out = torch.cat([out, x[..., 2 * half:]], dim=-1)
    return out[:, :num_q], out[:, num_q:]


def rotary(q, k, positions, cos_sin_cache):
    if q.is_cuda:
        from heron.core.ops import cuda
        return cuda.rotary(q, k, positions, cos_sin_cache)
    return rotary_ref(q, k, positions, cos_sin_cache)
