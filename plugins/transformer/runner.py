"""The transformer family's `ModelRunner`: binds the engine's KV cache to the model."""

from __future__ import annotations

import torch

from heron.core.batch import Batch
from heron.core.cache_spec import CacheSpec, CacheTensors, KVCacheSpec
from heron.core.family import ModelInfo, ModelRunner
from heron.plugins.transformer.model import TransformerModel


class TransformerRunner(ModelRunner):
    supports_cuda_graphs = True

    def __init__(self, model: TransformerModel, info: ModelInfo) -> None:
        self.model = model
        self.info = info
        self.cache: CacheTensors | None = None

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        return CacheSpec(kv=KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model.forward(batch, self.cache)
