"""Bidirectional attention over sequences packed into one flat batch (encoders: each row
attends to every row of its own sequence, none of the others)."""

from __future__ import annotations

from collections.abc import Callable

import torch

PackedAttention = Callable[..., torch.Tensor]


def packed_attention(sizes: list[int], scale: float, device: torch.device,
                     window: int | None = None) -> PackedAttention:
    """``attention(q, k, v, bias=None)`` for packed rows ``[N, H, D]`` of sequences of
    ``sizes`` rows, one after another; returns ``[N, H * D]``. With ``window``, a row
    attends only to rows at most that many positions from its own (a local layer's sliding
    window, both ways). ``bias(q, k)``, of the padded ``[sequences, H, longest, D]`` q and
    k, gives an additive score bias ``[sequences, H, longest, longest]`` (DeBERTa's relative
    positions), added to the scaled ``q . k``. One padded SDPA call: the padding is built
    once here and shared by every layer's call."""
    longest = max(sizes)
    # each packed row's place in the padded [sequences * longest] layout
    place = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(sizes)]).to(device)
    keys = torch.arange(longest)
    mask = (keys[None, :] < torch.tensor(sizes)[:, None])[:, None, None, :]
    if window is not None:  # [sequences, 1, 1, longest] -> [sequences, 1, longest, longest]
        mask = mask & ((keys[:, None] - keys[None, :]).abs() <= window)
    mask = mask.to(device)

    def pad(t):  # [N, H, D] -> [sequences, H, longest, D]
        out = t.new_zeros(len(sizes) * longest, *t.shape[1:])
        out.index_copy_(0, place, t)
        return out.view(len(sizes), longest, *t.shape[1:]).transpose(1, 2)

    def attention(q, k, v, bias=None):
        q, k = pad(q), pad(k)
        scores = mask if bias is None else bias(q, k).masked_fill(~mask, float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, pad(v), attn_mask=scores,
                                                             scale=scale)
        o = o.transpose(1, 2).reshape(len(sizes) * longest, -1)
        return o.index_select(0, place)

    return attention
