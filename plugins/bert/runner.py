"""The bert family's `ModelRunner`: whole inputs through the encoder, no KV kept.

Every token attends to every other of its input, so an input computes in one step
(`attends_whole_prompt`: the engine never splits one) and nothing outlives the step: the
engine's KV blocks are zero-byte bookkeeping (a cache of no layers).
"""

from __future__ import annotations

import torch

from heron.core import Batch, CacheSpec, CacheTensors, KVCacheSpec, ModelInfo, ModelRunner
from heron.plugins.bert.model import EncoderModel
from heron.plugins.bert.modernbert import ModernBertModel


class EncoderRunner(ModelRunner):
    attends_whole_prompt = True
    supports_hidden_states = True

    def __init__(self, model: EncoderModel | ModernBertModel, info: ModelInfo,
                 sep_token_id: int | None = None, default_pooling: str = "cls") -> None:
        """``sep_token_id``: the token that ends an input's first text, after which its
        tokens are of type 1 (None: the model takes no token types, or the tokenizer
        gives every token type 0)."""
        self.model, self.info = model, info
        self.classifier = model.head
        self.sep_token_id = sep_token_id
        self.default_pooling = default_pooling

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kv=KVCacheSpec(0, self.model.cfg.num_heads, self.model.cfg.head_dim))

    def bind_cache(self, cache: CacheTensors) -> None:
        pass

    def token_types(self, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Each token's type, as the tokenizer's pair template gives it: 1 past the first
        separator of its input (a cross-encoder's second text), else 0; None: all 0."""
        if self.sep_token_id is None:
            return None
        sep = ids == self.sep_token_id
        return torch.cat([(s.cumsum(0) - s.long()) > 0 for s in sep.split(sizes)]).long()

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        meta = batch.attn
        sizes = meta.query_lens_list
        if sizes != meta.seq_lens_list:
            raise RuntimeError("an encoder's input must compute whole in one step")
        hidden = self.model.forward(batch.input_ids, batch.positions, sizes,
                                    self.token_types(batch.input_ids, sizes))
        # the engine only builds embedding and classification batches for this family
        # (`keep_hidden_states`): no logits
        self.hidden_states = hidden
        return hidden[:0]
