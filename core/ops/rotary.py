"""Rotary position embeddings (neox / rotate-half layout, as HF Llama uses)."""

from __future__ import annotations

import math

import torch


def rope_type(scaling: dict | None) -> str:
    """A rope scaling's type, as transformers 5 (``rope_type``) or older configs (``type``)
    name it; "default" for none."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(rot_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies for ``rot_dim`` rotated dims, with optional rope scaling.

    Supported ``scaling["rope_type"]``: ``default``, ``linear``, ``llama3``, ``yarn``
    (whose cos and sin are also scaled: `rope_attention_factor`).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).double() / rot_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq.float()
    if kind == "yarn":
        return _yarn_inv_freq(rot_dim, base, scaling)
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
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
    raise ValueError(f"unsupported rope scaling type {kind!r} (heron serves default, "
                     "linear, llama3 and yarn)")


def _yarn_inv_freq(rot_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (arXiv 2309.00071, as transformers computes them): the fastest
    extrapolated, the slowest interpolated by ``factor``, a linear ramp between the
    dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:
        return rot_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low)
            / ((high - low) or 0.001)).clamp(0, 1)
    return (1 / (factor * pos_freqs)) * ramp + (1 / pos_freqs) * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature, so that the
    logits grow by its square): ``attention_factor``, else from ``factor`` (and
    DeepSeek's ``mscale`` / ``mscale_all_dim``); 1 for other rope types."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def temperature(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, all_dim = (scaling["factor"], scaling.get("mscale"),
                               scaling.get("mscale_all_dim"))
    if mscale and all_dim:
        return temperature(factor, mscale) / temperature(factor, all_dim)
    return temperature(factor)


def rope_cos_sin_cache(rot_dim: int, max_positions: int, base: float,
                       scaling: dict | None = None) -> torch.Tensor:
    """``[max_positions, rot_dim]`` float32: cos of each frequency, then sin (times
    `rope_attention_factor`)."""
    inv_freq = rope_inv_freq(rot_dim, base, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    factor = rope_attention_factor(scaling)
    return cos_sin if factor == 1.0 else cos_sin * factor


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
