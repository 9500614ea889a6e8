"""Scratch memory that a step's ops reuse from layer to layer and from step to step."""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named scratch buffers, each grown to the largest size asked of it and then kept.

    On the CPU a fresh tensor of tens of MB (a decode batch's gathered keys) comes from
    memory the allocator maps anew for it, and the page faults of its first touch cost about
    as much as filling it; a kept buffer pays them once. A buffer's contents last until the
    next `take` of its name.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` with ``like``'s dtype and device."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)
