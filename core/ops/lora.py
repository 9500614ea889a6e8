"""Multi-LoRA: adapter deltas for a batch whose sequences use different adapters (or none).

One forward pass serves every adapter, as SGMV/BGMV kernels do on GPUs; the engine
zero-pads every adapter to ``max_rank`` (padding adds exact zeros) and stores B transposed.
On CPU, two ways, picked per step:
  - small batches (decode): one dense shrink over every slot's A, a per-row mask that keeps
    each row's own adapter (scaled), one expand: three ops per projection, however many
    adapters are in the batch;
  - larger ones (prefill): the engine orders sequences by adapter, so each adapter's rows
    are one contiguous segment, which takes its own shrink and expand on views.
On CUDA, two kernels (shrink, expand) in which each row reads its own adapter.
The per-row and dense forms read only the batch's device tensors (``Batch.lora_slots``,
``CacheTensors.lora_scaling``), so a captured CUDA graph replays them.
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


def runs_per_row(weights: torch.Tensor) -> bool:
    """Whether adapters on ``weights``' device run as per-row kernels (CUDA)."""
    return weights.is_cuda


class LayerLora:
    """One layer's adapter weights for one step; `apply` is a no-op for targets no
    adapter may change. ``rows``: each row's adapter slot (-1: none) and scaling [T]
    float32, for the CUDA kernels."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 scaling: list[float] | None, segments: list[tuple[int, int, int]],
                 mask: torch.Tensor | None,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.weights, self.scaling, self.segments, self.mask = weights, scaling, segments, mask
        self.rows = rows

    def apply(self, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        pair = self.weights.get(target)
        if pair is None:
            return
        if self.rows is not None:
            from heron.core.ops import cuda
            cuda.add_lora_rows(out, x, pair[0], pair[1], *self.rows)
        else:
            add_lora(out, x, pair[0], pair[1], self.scaling, self.segments, self.mask)


def layer_loras(lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: torch.Tensor,
                row_slots: torch.Tensor | None, segments: list[tuple[int, int, int]],
                num_layers: int) -> list[LayerLora | None]:
    """Per layer, what `LayerLora` to apply this step. ``row_slots [T]``: each row's adapter
    slot, -1 for none (None: no row has one); ``segments``: the same as runs of rows
    (empty in a captured graph's batch, which takes a form that does not need them)."""
    if row_slots is None:
        return [None] * num_layers
    a = next(iter(lora.values()))[0]
    num_rows = row_slots.shape[0]
    mask = rows = scales = None
    if runs_per_row(a):
        rows = (row_slots, scaling.index_select(0, row_slots.clamp(min=0)).float())
    elif num_rows <= DENSE_MAX_ROWS or not segments:
        slots, rank = a.shape[1], a.shape[2]
        own = row_slots[:, None] == torch.arange(slots, device=row_slots.device)
        mask = (own * scaling).to(a.dtype).repeat_interleave(rank, dim=1)  # [T, slots * R]
    else:
        scales = scaling.tolist()  # one sync per step, not one per matmul
    return [LayerLora({t: (a[i], b[i]) for t, (a, b) in lora.items()}, scales, segments, mask,
                      rows) for i in range(num_layers)]
