"""Multi-LoRA: adapter deltas for a batch whose sequences use different adapters (or none).

Rows are grouped by adapter slot and each group takes two small matmuls (shrink to rank r,
expand back): one forward pass serves every adapter, as SGMV kernels do on GPUs. The
engine zero-pads every adapter to ``max_rank``, so padding adds exact zeros.
"""

from __future__ import annotations

import torch


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> None:
    """``out[rows] += scaling[s] * (x[rows] @ a[s].T) @ b[s].T`` for each ``(s, rows)``.

    ``x [T, in]``, ``out [T, out]`` (may be a column slice of a fused projection),
    ``a [slots, R, in]``, ``b [slots, out, R]``, ``scaling [slots]``, ``rows [n]`` int64.
    """
    for slot, rows in groups:
        shrunk = x.index_select(0, rows) @ a[slot].T
        out.index_add_(0, rows, (shrunk @ b[slot].T) * scaling[slot])


class LayerLora:
    """One layer's adapter weights for one step; `apply` is a no-op for targets no
    adapter may change."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 scaling: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> None:
        self.weights, self.scaling, self.groups = weights, scaling, groups

    def apply(self, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        pair = self.weights.get(target)
        if pair is not None:
            add_lora(out, x, pair[0], pair[1], self.scaling, self.groups)


def layer_loras(lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: torch.Tensor,
                groups: list[tuple[int, torch.Tensor]], num_layers: int) -> list[LayerLora | None]:
    """Per layer, what `LayerLora` to apply this step (all None without adapter rows)."""
    if not groups:
        return [None] * num_layers
    return [LayerLora({t: (a[i], b[i]) for t, (a, b) in lora.items()}, scaling, groups)
            for i in range(num_layers)]
