"""The NLLB family's `ModelRunner`: the decoder over the engine's paged KV, the encoder once
per sequence, its cross-attention K/V in engine-owned state slots.

A sequence's encoder runs in the step that computes its first decoder token (again after a
preemption by recompute, since the engine frees the slot); the step's decoder rows then
attend to their own sequence's slot. The engine gives encoder-decoder models no prefix
cache, so a slot always starts empty.
"""

from __future__ import annotations

import torch

from heron.core import (Batch, CacheSpec, CacheTensors, KVCacheSpec, ModelInfo, ModelRunner,
                        StateSpec)
from heron.core.ops import paged_attention, write_kv
from heron.plugins.nllb.model import NllbModel, attend


class NllbRunner(ModelRunner):
    is_encoder_decoder = True

    def __init__(self, model: NllbModel, info: ModelInfo) -> None:
        self.model, self.info = model, info
        self.max_encoder_len = model.cfg.max_position_embeddings
        self.cache: CacheTensors | None = None

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        heads, head_dim = cfg.num_decoder_heads, cfg.decoder_head_dim
        return CacheSpec(
            kv=KVCacheSpec(cfg.num_decoder_layers, heads, head_dim),
            states=(StateSpec("cross_kv", (cfg.num_decoder_layers, 2, self.max_encoder_len,
                                           heads, head_dim)),
                    StateSpec("cross_len", (1,), torch.int64)))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache

    def fork_state(self, cache: CacheTensors, parent_slot: int, child_slot: int) -> None:
        # only the source's rows: a slot is sized for the longest source
        cross, lengths = cache.states["cross_kv"], cache.states["cross_len"]
        length = int(lengths[parent_slot, 0])
        cross[child_slot, :, :, :length].copy_(cross[parent_slot, :, :, :length])
        lengths[child_slot].copy_(lengths[parent_slot])

    def _batched_cross_attention(self, slots: list[int], sources: list[int], scale: float):
        """Cross-attention for one query row per sequence, in one call per layer over the
        slot tensor itself (no gather): queries go to their sequences' slots, and the slots
        no sequence of this batch holds attend to nothing that is used."""
        cross = self.cache.states["cross_kv"]
        num = max(slots) + 1
        longest = max(sources)
        index = torch.tensor(slots, device=cross.device)
        lengths = torch.zeros(num, dtype=torch.long, device=cross.device)
        lengths[index] = torch.tensor(sources, device=cross.device)
        mask = (torch.arange(longest, device=cross.device)[None, :] < lengths[:, None])
        mask = mask[:, None, None, :]  # [slots, 1, 1, S]
        mask[lengths == 0] = True  # unused slots: any finite row, discarded below

        def cross_attention(i, q):  # q [B, heads, head_dim]
            heads, head_dim = q.shape[1:]
            q_all = q.new_zeros(num, heads, 1, head_dim)
            q_all[index] = q[:, :, None, :]
            k = cross[:num, i, 0, :longest].transpose(1, 2)  # [slots, heads, S, head_dim]
            v = cross[:num, i, 1, :longest].transpose(1, 2)
            o = torch.nn.functional.scaled_dot_product_attention(q_all, k, v, attn_mask=mask,
                                                                 scale=scale)
            return o[index].reshape(len(slots), heads * head_dim)

        return cross_attention

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        model, cfg = self.model, self.model.cfg
        cross, lengths = self.cache.states["cross_kv"], self.cache.states["cross_len"]
        slots = batch.state_slots_list
        for seq, slot in zip(batch.seqs, slots):
            if seq.num_computed_tokens == 0:  # its first decoder rows: encode its source
                source = torch.tensor(seq.encoder_token_ids, device=cross.device)
                for i, (k, v) in enumerate(model.cross_kv(model.encode(source))):
                    cross[slot, i, 0, :len(source)] = k
                    cross[slot, i, 1, :len(source)] = v
                lengths[slot, 0] = len(source)
        sources = lengths[batch.state_slots, 0].tolist()
        starts = batch.attn.query_start_loc.tolist()
        scale = cfg.decoder_head_dim ** -0.5

        def self_attention(i, q, k, v):
            k_cache, v_cache = self.cache.layer_kv(i)
            write_kv(k, v, k_cache, v_cache, batch.attn.slot_mapping)
            o = paged_attention(q.contiguous(), k_cache, v_cache, batch.attn, scale)
            return o.reshape(q.shape[0], -1)

        if len(slots) == batch.num_tokens:  # decode only: one query row per sequence
            cross_attention = self._batched_cross_attention(slots, sources, scale)
        else:
            def cross_attention(i, q):  # each sequence's rows over its own source
                return torch.cat([attend(q[a:b], cross[slot, i, 0, :s], cross[slot, i, 1, :s],
                                         scale)
                                  for a, b, slot, s in zip(starts, starts[1:], slots, sources)])

        x = model.decoder(model.embed_decoder_tokens(batch.input_ids, batch.positions),
                          self_attention, cross_attention)
        return model.logits(x.index_select(0, batch.logits_indices))
