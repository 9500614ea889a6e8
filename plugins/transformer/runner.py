"""The transformer family's `ModelRunner`: binds the engine's KV cache to the model."""

from __future__ import annotations

import torch

from heron.core.batch import Batch
from heron.core.cache_spec import CacheSpec, CacheTensors, KVCacheSpec
from heron.core.family import ModelInfo, ModelRunner
from heron.core.lora import LoraTarget
from heron.plugins.transformer.model import TransformerModel


class TransformerRunner(ModelRunner):
    supports_cuda_graphs = True
    supports_cpu_graphs = True
    supports_hidden_states = True

    def __init__(self, model: TransformerModel, info: ModelInfo) -> None:
        self.model = model
        self.info = info
        self.cache: CacheTensors | None = None
        self.classifier = model.classifier

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        return CacheSpec(kv=KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache

    def lora_targets(self) -> tuple[LoraTarget, ...]:
        cfg = self.model.cfg
        hidden, layers = self.model.embed.shape[1], cfg.num_layers
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = self.model.layers[0].down.shape[1]
        return tuple(LoraTarget(name, layers, i, o) for name, i, o in (
            ("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv),
            ("o_proj", q, hidden), ("gate_proj", hidden, inter), ("up_proj", hidden, inter),
            ("down_proj", inter, hidden)))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.keeping_hidden_states(
            lambda hidden: self.model.forward(batch, self.cache, hidden,
                                              self.hidden_states_layers))
