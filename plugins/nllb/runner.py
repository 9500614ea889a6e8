"""The NLLB family's `ModelRunner`: the decoder over the engine's paged KV, the encoder once
per sequence, its cross-attention K/V in engine-owned state slots.

The encoder runs in stages of one layer (`encode`), the sources of every sequence that runs
a layer in a step packed into one batch; between steps a partly encoded source's hidden
states wait in its slot. Its last stage writes the cross-attention K/V of every decoder
layer into the slot, where the sequence's decoder rows read them. A preemption by recompute
frees the slot, so the encoder runs again; the engine gives encoder-decoder models no
prefix cache, so a slot always starts empty.
"""

from __future__ import annotations

import itertools

import torch

from heron.core import (Batch, CacheSpec, CacheTensors, EncoderChunk, KVCacheSpec, ModelInfo,
                        ModelRunner, StateSpec)
from heron.core.ops import packed_attention, paged_attention, write_kv
from heron.plugins.nllb.model import NllbModel, attend


class NllbRunner(ModelRunner):
    is_encoder_decoder = True
    forks_share_states = True  # the slot's cross-attention K/V stay fixed once decoding starts

    def __init__(self, model: NllbModel, info: ModelInfo) -> None:
        self.model, self.info = model, info
        self.max_encoder_len = model.cfg.max_position_embeddings
        self.encoder_stages = model.cfg.num_encoder_layers
        self.cache: CacheTensors | None = None

    def cache_spec(self) -> CacheSpec:
        cfg = self.model.cfg
        heads, head_dim = cfg.num_decoder_heads, cfg.decoder_head_dim
        return CacheSpec(
            kv=KVCacheSpec(cfg.num_decoder_layers, heads, head_dim),
            # heads before positions: one head's keys are one matrix for the matmuls. Not
            # zeroed for a new sequence (6 MB a slot at d_model 512): `encode` writes its
            # source's rows and zeroes the rest that any earlier holder may have filled
            states=(StateSpec("cross_kv", (cfg.num_decoder_layers, 2, heads,
                                           self.max_encoder_len, head_dim), zero_fresh=False),
                    StateSpec("encoder_hidden", (self.max_encoder_len, cfg.d_model),
                              zero_fresh=False)))

    def bind_cache(self, cache: CacheTensors) -> None:
        self.cache = cache
        # per slot, the length of the source last encoded there, past which its
        # cross-attention rows are zeros (at first: none known to be); on the host, so that
        # a decode step reads no device tensor to learn it
        self._source_len = [self.max_encoder_len] * cache.states["cross_kv"].shape[0]

    @torch.inference_mode()
    def encode(self, chunks: list[EncoderChunk]) -> None:
        model, states = self.model, self.cache.states
        hidden = states["encoder_hidden"]
        dev = hidden.device
        sizes = [len(c.seq.encoder_token_ids) for c in chunks]
        # every source row's (slot, position), chunk after chunk
        slot_of = torch.repeat_interleave(torch.tensor([c.slot for c in chunks]),
                                          torch.tensor(sizes)).to(dev)
        position = torch.cat([torch.arange(n) for n in sizes]).to(dev)
        ids = torch.tensor([t for c in chunks for t in c.seq.encoder_token_ids], device=dev)
        x = model.embed_source_tokens(ids, position)
        chunk_of = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(sizes)).to(dev)
        resumed = torch.tensor([c.start > 0 for c in chunks], device=dev)[chunk_of]
        if bool(resumed.any()):
            x[resumed] = hidden[slot_of[resumed], position[resumed]]
        scale = model.cfg.encoder_head_dim ** -0.5
        everyone = packed_attention(sizes, scale, dev)
        for i in range(min(c.start for c in chunks), max(c.end for c in chunks)):
            active = [c.start <= i < c.end for c in chunks]
            if all(active):
                x = model.encoder_layer(i, x, everyone)
                continue
            rows = torch.tensor(active, device=dev)[chunk_of]
            attention = packed_attention([n for n, a in zip(sizes, active) if a], scale, dev)
            x[rows] = model.encoder_layer(i, x[rows], attention)
        finished = [c.end == self.encoder_stages for c in chunks]
        done = torch.tensor(finished, device=dev)[chunk_of]
        hidden[slot_of[~done], position[~done]] = x[~done]
        if not any(finished):
            return
        cross = states["cross_kv"]
        slots, positions = slot_of[done], position[done]
        for i, (k, v) in enumerate(model.cross_kv(model.encoder_output(x[done]))):
            cross[slots, i, 0, :, positions] = k  # k, v [rows, heads, head_dim]
            cross[slots, i, 1, :, positions] = v
        ended = [(c.slot, n) for c, n, f in zip(chunks, sizes, finished) if f]
        for slot, n in ended:  # keys past a source are masked, their rows zeros (0 * inf: NaN)
            if self._source_len[slot] > n:
                cross[slot, :, :, :, n:self._source_len[slot]] = 0
            self._source_len[slot] = n

    def _grouped_cross_attention(self, slots: list[int], sources: list[int], scale: float):
        """Cross-attention of a batch whose row ``r`` reads slot ``slots[r]`` (a source of
        ``sources[r]`` tokens), one call per layer: the rows that share a slot (a sequence's
        rows, the beams of one request) query its K/V together, so each source is read
        once. None when padding every slot's queries to the most any slot has would more
        than double them (a long decoder prompt among single rows).

        Batched matmuls, not SDPA: with a few queries per slot and head, the CPU's SDPA
        spends its time setting up thousands of tiny blocks (1.4 ms a layer for 64 slots of
        4 beams, 0.4 ms as matmuls)."""
        cross = self.cache.states["cross_kv"]
        dev, longest = cross.device, max(sources)
        group_of, lengths, rank, seen = {}, [], [], []  # per slot: group, its source
        for slot, n in zip(slots, sources):  # and each row's place among its slot's rows
            g = group_of.setdefault(slot, len(group_of))
            if g == len(seen):
                seen.append(0)
                lengths.append(n)
            rank.append(seen[g])
            seen[g] += 1
        num_groups, group_size = len(group_of), max(seen)
        if num_groups * group_size > 2 * len(slots) + 64:
            return None
        # row r's query goes to place[r] of the [groups * group_size] queries
        place = [group_of[slot] * group_size + r for slot, r in zip(slots, rank)]
        in_place = place == list(range(num_groups * group_size))
        place = torch.tensor(place, device=dev)
        keys = torch.arange(longest, device=dev) < torch.tensor(lengths, device=dev)[:, None]
        bias = torch.zeros(keys.shape, device=dev, dtype=cross.dtype).masked_fill_(
            ~keys, float("-inf"))[:, None, None, :]  # [groups, 1, 1, longest]
        index = torch.tensor(list(group_of), device=dev)

        def cross_attention(i, q):  # q [B, heads, head_dim]
            heads, head_dim = q.shape[1:]
            if not in_place:
                q = q.new_zeros(num_groups * group_size, heads, head_dim).index_copy_(0, place, q)
            q = q.view(num_groups, group_size, heads, head_dim).transpose(1, 2)
            # the batch's slots, each [heads, longest, head_dim], copied together: fast rows
            k = cross[:, i, 0, :, :longest].index_select(0, index)
            v = cross[:, i, 1, :, :longest].index_select(0, index)
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias)
            o = torch.matmul(torch.softmax(scores, -1), v)  # [groups, heads, size, head_dim]
            o = o.transpose(1, 2).reshape(num_groups * group_size, heads * head_dim)
            return o if in_place else o.index_select(0, place)

        return cross_attention

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        model, cfg = self.model, self.model.cfg
        cross = self.cache.states["cross_kv"]
        slots = batch.state_slots_list
        sources = [self._source_len[slot] for slot in slots]
        starts = [0, *itertools.accumulate(batch.attn.query_lens_list)]
        scale = cfg.decoder_head_dim ** -0.5

        def self_attention(i, q, k, v):
            k_cache, v_cache = self.cache.layer_kv(i)
            write_kv(k, v, k_cache, v_cache, batch.attn.slot_mapping)
            o = paged_attention(q.contiguous(), k_cache, v_cache, batch.attn, scale)
            return o.reshape(q.shape[0], -1)

        num_rows = batch.attn.query_lens_list
        cross_attention = self._grouped_cross_attention(
            [slot for slot, n in zip(slots, num_rows) for _ in range(n)],
            [s for s, n in zip(sources, num_rows) for _ in range(n)], scale)
        if cross_attention is None:
            def cross_attention(i, q):  # each sequence's rows over its own source
                return torch.cat([attend(q[a:b], cross[slot, i, 0, :, :s].transpose(0, 1),
                                         cross[slot, i, 1, :, :s].transpose(0, 1), scale)
                                  for a, b, slot, s in zip(starts, starts[1:], slots, sources)])

        x = model.decoder(model.embed_decoder_tokens(batch.input_ids, batch.positions),
                          self_attention, cross_attention)
        return model.logits(x.index_select(0, batch.logits_indices))

