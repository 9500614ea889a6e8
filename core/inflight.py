"""Async scheduling: a step's sampled tokens stay on the device while the next step runs.

With ``engine.async_scheduling`` the engine launches step N+1 before it reads step N's
tokens on the host, so that the host's work (scheduling, batch building, detokenizing,
stop checks) overlaps the device's. Until step N's tokens land, each sequence that
sampled in it ends with a *placeholder*: the id ``-1 - i`` for row ``i`` of the step's
sampled tokens. A batch that feeds a placeholder to the model takes the token from the
device (`fill_placeholders`); the host replaces it once the tokens land, one step later.

NOTE: between steps, only running sequences hold a placeholder, as their last token, not
yet computed; everything before it is real. A stop found when the tokens land has let
the sequence run one more step, as a decode (one row, dropped). The KV and state that
step wrote are valid: the stopping token's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.core.sampler import PendingSample
from heron.core.sequence import Sequence


@dataclass(slots=True)
class InflightStep:
    """A step whose sampled tokens have not reached the host: ``seqs[i]`` sampled row ``i``
    of ``sample`` and holds `placeholder` ``(i)`` as its last token."""

    seqs: list[Sequence]
    sample: PendingSample


def placeholder(row: int) -> int:
    """The token id that stands for row ``row`` of the step in flight's sampled tokens."""
    return -1 - row


def fill_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each placeholder replaced by its token of ``sampled`` (the step in
    flight's `PendingSample.token_ids`), on the device, without a host sync. A failed row's
    token (-1; its sequence ends when the tokens land) reads as 0, a valid id."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, sampled.clamp(min=0)[rows], input_ids)
