"""What memory a model family needs from the engine, and what the engine hands back.

A family declares a `CacheSpec`; the engine sizes and allocates every tensor in it and
binds a `CacheTensors` to the family before the first step. Families never allocate cache
memory themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Paged self-attention KV: one K and one V block per layer per block id."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size per-sequence state kept in slots (SSM conv/scan state, cross-attention KV).

    ``shape`` is the shape of one slot; the engine allocates ``(num_slots, *shape)`` and
    gives each running sequence one slot (``batch.state_slots``). Contract: when ``forward``
    starts, the slot holds the state after the sequence's already computed tokens (zeros for
    a fresh sequence, or a snapshot the prefix cache restored); ``forward`` leaves it holding
    the state after the sequence's last row in the batch.

    ``zero_fresh=False``: a fresh sequence's slot keeps what its last holder left instead
    of zeros (the family writes what it reads, and the engine saves zeroing a large slot).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the model dtype
    zero_fresh: bool = True


@dataclass(frozen=True)
class CacheSpec:
    kv: KVCacheSpec | None = None
    states: tuple[StateSpec, ...] = ()


@dataclass
class CacheTensors:
    """Memory the engine allocated for a `CacheSpec`.

    ``kv`` has shape ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``;
    ``states[name]`` has shape ``(num_slots, *spec.shape)``.
    """

    block_size: int
    kv: torch.Tensor | None = None
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    # LoRA adapter slots (families with `lora_targets`, when adapters are configured):
    # target -> (A [layers, slots, max_rank, in], B transposed [layers, slots, max_rank, out])
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lora_scaling: torch.Tensor | None = None  # [slots]
    _kv_views: tuple[torch.Tensor, list] | None = field(default=None, repr=False,
                                                        compare=False)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv is not None
        # the views are made once per cache: a step asks for every layer's, and indexing
        # costs microseconds a call on the CPU
        if self._kv_views is None or self._kv_views[0] is not self.kv:
            self._kv_views = (self.kv, [(kv[0], kv[1]) for kv in self.kv])
        return self._kv_views[1][layer]
