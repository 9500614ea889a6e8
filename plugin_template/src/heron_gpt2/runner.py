"""GPT-2's `ModelRunner`: declares the KV cache it needs and runs the model on it."""

from __future__ import annotations

import torch

from heron.core import Batch, CacheSpec, CacheTensors, KVCacheSpec, ModelInfo, ModelRunner
from heron_gpt2.model import GPT2Model


class GPT2Runner(ModelRunner):
    def __init__(self, model: GPT2Model, info: ModelInfo) -> None:
        self.model = model
        self.info = info
        self.cache: CacheTensors | None = None

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        # multi-head attention: as many KV heads as query heads
        return CacheSpec(kv=KVCacheSpec(cfg.num_layers, cfg.num_heads, cfg.head_dim))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model.forward(batch, self.cache)
