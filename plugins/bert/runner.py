"""The bert family's `ModelRunner`: whole inputs through the encoder, no KV kept.

Every token attends to every other of its input, so an input computes in one step
(`attends_whole_prompt`: the engine never splits one) and nothing outlives the step: the
engine's KV blocks are zero-byte bookkeeping (a cache of no layers).
"""

from __future__ import annotations

import torch

from heron.core import Batch, CacheSpec, CacheTensors, KVCacheSpec, ModelInfo, ModelRunner
from heron.plugins.bert.deberta import DebertaModel
from heron.plugins.bert.model import EncoderModel
from heron.plugins.bert.modernbert import ModernBertModel
from heron.plugins.bert.rope_encoder import RopeEncoderModel


class EncoderRunner(ModelRunner):
    attends_whole_prompt = True
    supports_hidden_states = True

    def __init__(self, model: EncoderModel | ModernBertModel | DebertaModel | RopeEncoderModel,
                 info: ModelInfo,
                 default_pooling: str = "cls", num_token_types: int = 0) -> None:
        self.model, self.info = model, info
        self.classifier = model.head
        self.default_pooling = default_pooling
        self.num_token_types = num_token_types

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kv=KVCacheSpec(0, self.model.cfg.num_heads, self.model.cfg.head_dim))

    def bind_cache(self, cache: CacheTensors) -> None:
        pass

    def token_types(self, batch: Batch) -> torch.Tensor | None:
        """Each row's token type, as its request gave them; None: all 0."""
        if not any(seq.token_type_ids for seq in batch.seqs):
            return None
        types = [seq.token_type_ids or (0,) * n
                 for seq, n in zip(batch.seqs, batch.attn.query_lens_list)]
        return torch.tensor([t for row in types for t in row], device=batch.input_ids.device)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        meta = batch.attn
        sizes = meta.query_lens_list
        if sizes != meta.seq_lens_list:
            raise RuntimeError("an encoder's input must compute whole in one step")
        hidden = self.model.forward(batch.input_ids, batch.positions, sizes,
                                    self.token_types(batch))
        # the engine only builds embedding and classification batches for this family
        # (`keep_hidden_states`): no logits
        self.hidden_states = hidden
        return hidden[:0]
