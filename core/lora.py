"""What LoRA adapters are to the engine: the projections a family lets adapters change,
and an adapter's weights as an adapter-format plugin loads them.

The engine owns the adapter slots (`heron.core.adapter_pool`) and their weight tensors
(``CacheTensors.lora``); a family applies them (``heron.core.ops.lora``); a plugin reads
adapter files (hook ``heron_register_adapter_loaders``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class AdapterError(ValueError):
    """A bad adapter. The message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraTarget:
    """One projection adapters may change, in every layer: ``y += scale * x @ A.T @ B.T``
    with ``A [r, in_features]`` and ``B [out_features, r]``. ``name`` is the projection's
    module name in Hugging Face checkpoints (``q_proj``, ``down_proj``...)."""

    name: str
    num_layers: int
    in_features: int
    out_features: int


@dataclass
class AdapterWeights:
    """A loaded adapter, in host memory. ``layers[target][i]`` is ``(A, B)`` for layer ``i``,
    or None where the adapter leaves that projection alone; targets it leaves alone
    entirely are absent. ``scaling`` is ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]


class AdapterBusyError(AdapterError):
    """The adapter cannot be removed: requests that use it are still running or waiting."""
