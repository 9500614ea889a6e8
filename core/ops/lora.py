"""Multi-LoRA: adapter deltas for a batch whose sequences use different adapters (or none).

One forward pass serves every adapter, as SGMV/BGMV kernels do on GPUs; the engine
zero-pads every adapter to ``max_rank`` (padding adds exact zeros) and stores B transposed.
Two ways, picked per step:
  - small batches (decode): one dense shrink over every slot's A, a per-row mask that keeps
    each row's own adapter (scaled), one expand: three ops per projection, however many
    adapters are in the batch;
  - larger ones (prefill): the engine orders sequences by adapter, so each adapter's rows
    are one contiguous segment, which takes its own shrink and expand on views.
"""

from __future__ import annotations

import torch

DENSE_MAX_ROWS = 64  # above this, the dense form's wasted work outweighs its fewer ops


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: list[float], segments: list[tuple[int, int, int]],
             mask: torch.Tensor | None = None) -> None:
    """``out[r0:r1] += scaling[s] * (x[r0:r1] @ a[s].T) @ b[s]`` per segment ``(s, r0, r1)``.

    ``x [T, in]``, ``out [T, out]`` (may be a column slice of a fused projection),
    ``a [slots, R, in]``, ``b [slots, R, out]``. With ``mask [T, slots * R]`` (each row's
    scaling on its own slot's columns, zeros elsewhere) the dense form does the same.
    """
    if mask is not None:
        slots, rank, _ = a.shape
        shrunk = (x @ a.reshape(slots * rank, -1).T).mul_(mask)
        out.addmm_(shrunk, b.reshape(slots * rank, -1))
        return
    for slot, r0, r1 in segments:
        out[r0:r1] += (x[r0:r1] @ a[slot].T @ b[slot]).mul_(scaling[slot])


class LayerLora:
    """One layer's adapter weights for one step; `apply` is a no-op for targets no
    adapter may change."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 scaling: list[float], segments: list[tuple[int, int, int]],
                 mask: torch.Tensor | None) -> None:
        self.weights, self.scaling, self.segments, self.mask = weights, scaling, segments, mask

    def apply(self, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        pair = self.weights.get(target)
        if pair is not None:
            add_lora(out, x, pair[0], pair[1], self.scaling, self.segments, self.mask)


def layer_loras(lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: torch.Tensor,
                segments: list[tuple[int, int, int]], num_rows: int,
                num_layers: int) -> list[LayerLora | None]:
    """Per layer, what `LayerLora` to apply this step (all None without adapter rows)."""
    if not segments:
        return [None] * num_layers
    scales = scaling.tolist()  # one sync per step, not one per matmul
    mask = None
    if num_rows <= DENSE_MAX_ROWS:
        a = next(iter(lora.values()))[0]
        slots, rank = a.shape[1], a.shape[2]
        mask = torch.zeros(num_rows, slots, rank, dtype=a.dtype, device=a.device)
        for slot, r0, r1 in segments:
            mask[r0:r1, slot] = scales[slot]
        mask = mask.view(num_rows, slots * rank)
    return [LayerLora({t: (a[i], b[i]) for t, (a, b) in lora.items()}, scales, segments, mask)
            for i in range(num_layers)]
