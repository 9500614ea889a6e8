"""M2M100 / NLLB encoder-decoder math: plain tensors and functional ops, no nn.Module.

`encode` one source sentence (no padding) and `cross_kv` once per request; `decoder` runs
the decoder stack with the attention supplied by the caller: `decode` keeps one sequence's
self-attention K/V in contiguous caches (`SequenceKV`, the reference the tests check
against transformers), the engine's runner (runner.py) a whole batch's in paged KV.

Checkpoint facts (transformers' ``modeling_m2m_100.py``): pre-norm layers with biased
projections and LayerNorm (eps 1e-5), a final LayerNorm after each stack, ReLU FFN, q scaled
by ``head_dim ** -0.5``, token embeddings scaled by ``sqrt(d_model)`` (``scale_embedding``),
and fixed sinusoidal positions whose first token sits at row ``pad_token_id + 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core.ops import linear, pack_weight
from heron.plugins.nllb.config import M2M100Config
from heron.plugins.transformer.model import Weights

KVPair = tuple[torch.Tensor, torch.Tensor]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CrossAttentionFn = Callable[[int, torch.Tensor], torch.Tensor]
EncoderAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Projection:
    weight: torch.Tensor            # [out, in], `pack_weight`-ed
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return linear(x, self.weight, self.bias, relu)


@dataclass
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class Layer:
    attn_norm: Norm
    qkv: Projection                 # self-attention q, k, v rows fused
    attn_out: Projection
    ffn_norm: Norm
    fc1: Projection
    fc2: Projection
    cross_norm: Norm | None = None  # decoder layers only: attention over the encoder output
    cross_q: Projection | None = None
    cross_kv: Projection | None = None  # k, v rows fused; applied once per request
    cross_out: Projection | None = None


@dataclass
class SequenceKV:
    """One sequence's decoder self-attention K/V, contiguous: per layer ``(k, v)`` of
    ``[max_len, heads, head_dim]``; rows ``[0, length)`` hold the tokens decoded so far.

    NOTE: `NllbModel.decode` writes rows ``[length, length + T)`` and then advances
    ``length``; nothing else may change it."""
    layers: list[KVPair]
    length: int = 0

    @classmethod
    def allocate(cls, cfg: M2M100Config, max_len: int, device, dtype) -> SequenceKV:
        shape = (max_len, cfg.num_decoder_heads, cfg.decoder_head_dim)
        return cls([(torch.zeros(shape, device=device, dtype=dtype),
                     torch.zeros(shape, device=device, dtype=dtype))
                    for _ in range(cfg.num_decoder_layers)])


def sinusoid_table(num_rows: int, dim: int, padding_idx: int) -> torch.Tensor:
    """transformers' ``M2M100SinusoidalPositionalEmbedding.get_embedding`` in float32: sin
    half then cos half (not interleaved), frequencies ``10000 ** (-i / (dim/2 - 1))``, and
    the padding row zeroed."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_rows, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = F.pad(table, (0, 1))
    table[padding_idx] = 0.0
    return table


def layer_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    return F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, eps)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, D]`` over ``k, v [S, H, D]``; ``mask [T, S]`` True where allowed (None:
    every key). Returns ``[T, H * D]``."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVPair, start: int,
                   scale: float) -> torch.Tensor:
    """Causal decoder self-attention of this step's ``q, k, v [T, H, D]`` (tokens
    ``start .. start + T - 1`` of the sequence): writes k, v into rows ``[start, start + T)``
    of ``kv = (k_cache, v_cache)`` and attends rows ``[0, start + T)``. Returns
    ``[T, H * D]``."""
    k_cache, v_cache = kv
    end = start + q.shape[0]
    k_cache[start:end] = k
    v_cache[start:end] = v
    mask = None
    if q.shape[0] > 1:  # query i sees keys 0 .. start + i
        rows = torch.arange(start, end, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= rows[:, None]
    return attend(q, k_cache[:end], v_cache[:end], scale, mask)


def ffn(h: torch.Tensor, layer: Layer) -> torch.Tensor:
    return layer.fc2(layer.fc1(h, relu=True))


class NllbModel:
    def __init__(self, cfg: M2M100Config, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        w = Weights(dict(tensors), device, dtype)
        self._take_embeddings(w)
        self.encoder_layers = [self._layer(w, f"model.encoder.layers.{i}.", is_decoder=False)
                               for i in range(cfg.num_encoder_layers)]
        self.decoder_layers = [self._layer(w, f"model.decoder.layers.{i}.", is_decoder=True)
                               for i in range(cfg.num_decoder_layers)]
        self.encoder_norm = self._norm(w, "model.encoder.layer_norm")
        self.decoder_norm = self._norm(w, "model.decoder.layer_norm")
        # NOTE: rows cover max_position_embeddings tokens after the padding offset; the
        # caller refuses longer sequences
        self.positions = sinusoid_table(cfg.max_position_embeddings + cfg.position_offset,
                                        cfg.d_model, cfg.pad_token_id).to(device, dtype)
        self.unused_tensors = sorted(k for k in w.tensors if "embed_positions" not in k)

    def _take_embeddings(self, w: Weights) -> None:
        # transformers 5 ties encoder, decoder and lm_head to `model.shared` only when
        # tie_word_embeddings is set; untied, each stack reads its own table and `shared`
        # is unused; a stack whose own table is missing falls back to `shared` (older
        # checkpoints may hold copies under every name).
        names = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
        shared = w.take("model.shared.weight", required=False)
        if self.cfg.tie_word_embeddings:
            for name in names:
                shared = _first(shared, w.take(name, required=False))
            w.take("lm_head.weight", required=False)
            if shared is None:
                raise KeyError("checkpoint has no tensor 'model.shared.weight'")
            self.encoder_embed = self.decoder_embed = shared
            self.lm_head = pack_weight(shared)
            return
        self.encoder_embed = _first(w.take(names[0], required=shared is None), shared)
        self.decoder_embed = _first(w.take(names[1], required=shared is None), shared)
        self.lm_head = pack_weight(w.take("lm_head.weight"))

    def _norm(self, w: Weights, p: str) -> Norm:
        return Norm(w.take(p + ".weight"), w.take(p + ".bias"))

    def _proj(self, w: Weights, names: list[str]) -> Projection:
        return Projection(pack_weight(w.cat([n + ".weight" for n in names])),
                          w.cat([n + ".bias" for n in names]))

    def _layer(self, w: Weights, p: str, is_decoder: bool) -> Layer:
        attn, cross = p + "self_attn.", p + "encoder_attn."
        layer = Layer(
            attn_norm=self._norm(w, p + "self_attn_layer_norm"),
            qkv=self._proj(w, [attn + f"{n}_proj" for n in "qkv"]),
            attn_out=self._proj(w, [attn + "out_proj"]),
            ffn_norm=self._norm(w, p + "final_layer_norm"),
            fc1=self._proj(w, [p + "fc1"]),
            fc2=self._proj(w, [p + "fc2"]))
        if is_decoder:
            layer.cross_norm = self._norm(w, p + "encoder_attn_layer_norm")
            layer.cross_q = self._proj(w, [cross + "q_proj"])
            layer.cross_kv = self._proj(w, [cross + "k_proj", cross + "v_proj"])
            layer.cross_out = self._proj(w, [cross + "out_proj"])
        return layer

    def _embed(self, table: torch.Tensor, ids: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings plus sinusoids; ``positions`` count from 0. As in
        transformers, a pad token takes the zero padding row instead of its position."""
        cfg = self.cfg
        rows = torch.where(ids == cfg.pad_token_id, cfg.pad_token_id,
                           positions + cfg.position_offset)
        return F.embedding(ids, table) * cfg.embed_scale + self.positions[rows]

    def embed_decoder_tokens(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder's input ``[T, d_model]`` for target tokens at 0-based positions."""
        return self._embed(self.decoder_embed, ids, positions)

    def embed_source_tokens(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The encoder's input ``[S, d_model]`` for source tokens at 0-based positions."""
        return self._embed(self.encoder_embed, ids, positions)

    def encoder_layer(self, i: int, x: torch.Tensor, attention: EncoderAttentionFn) -> torch.Tensor:
        """Encoder layer ``i`` over ``x [N, d_model]`` (rows of one or more sources), which
        gets its attention output ``[N, heads * head_dim]`` from ``attention(q, k, v)``
        (``[N, heads, head_dim]`` each, q unscaled; each source's rows see its own rows)."""
        cfg, layer = self.cfg, self.encoder_layers[i]
        h = layer_norm(x, layer.attn_norm, cfg.layer_norm_eps)
        q, k, v = layer.qkv(h).view(h.shape[0], 3, cfg.num_encoder_heads,
                                    cfg.encoder_head_dim).unbind(1)
        x = x + layer.attn_out(attention(q, k, v))
        return x + ffn(layer_norm(x, layer.ffn_norm, cfg.layer_norm_eps), layer)

    def encoder_output(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's output from its last layer's ``x``."""
        return layer_norm(x, self.encoder_norm, self.cfg.layer_norm_eps)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Encoder output ``[S, d_model]`` for one unpadded source ``input_ids [S]``
        (NLLB: ``[src_lang, ..., eos]``)."""
        scale = self.cfg.encoder_head_dim ** -0.5
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        x = self.embed_source_tokens(input_ids, positions)
        for i in range(len(self.encoder_layers)):
            x = self.encoder_layer(i, x, lambda q, k, v: attend(q, k, v, scale))
        return self.encoder_output(x)

    def cross_kv(self, enc: torch.Tensor) -> list[KVPair]:
        """Per decoder layer, the cross-attention ``(k, v)``, each ``[S, heads, head_dim]``,
        of the encoder output ``enc [S, d_model]``: computed once per request."""
        heads, head_dim = self.cfg.num_decoder_heads, self.cfg.decoder_head_dim
        return [tuple(layer.cross_kv(enc).view(enc.shape[0], 2, heads, head_dim).unbind(1))
                for layer in self.decoder_layers]

    def decoder(self, x: torch.Tensor, self_attention: AttentionFn,
                cross_attention: CrossAttentionFn) -> torch.Tensor:
        """The decoder stack over embedded tokens ``x [T, d_model]``. Layer ``i`` gets its
        attention outputs ``[T, heads * head_dim]`` from ``self_attention(i, q, k, v)`` (which
        owns where this step's K/V go) and ``cross_attention(i, q)``; ``q, k, v [T, heads,
        head_dim]``, q unscaled. Returns the final hidden states ``[T, d_model]``."""
        cfg = self.cfg
        eps, heads, head_dim = cfg.layer_norm_eps, cfg.num_decoder_heads, cfg.decoder_head_dim
        num_tokens = x.shape[0]
        for i, layer in enumerate(self.decoder_layers):
            h = layer_norm(x, layer.attn_norm, eps)
            q, k, v = layer.qkv(h).view(num_tokens, 3, heads, head_dim).unbind(1)
            x = x + layer.attn_out(self_attention(i, q, k, v))
            h = layer_norm(x, layer.cross_norm, eps)
            q = layer.cross_q(h).view(num_tokens, heads, head_dim)
            x = x + layer.cross_out(cross_attention(i, q))
            x = x + ffn(layer_norm(x, layer.ffn_norm, eps), layer)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of decoder hidden states ``h [R, d_model]``."""
        return linear(layer_norm(h, self.decoder_norm, self.cfg.layer_norm_eps),
                      self.lm_head).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, self_kv: SequenceKV,
               cross: list[KVPair], last_only: bool = False) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` (``[1, vocab]`` with ``last_only``) of one
        sequence's next ``tokens [T]`` at ``positions [T]`` (0-based, ``self_kv.length``
        onwards: the decoder-start token is position 0). Appends their K/V to ``self_kv``."""
        scale, start = self.cfg.decoder_head_dim ** -0.5, self_kv.length
        x = self.decoder(
            self.embed_decoder_tokens(tokens, positions),
            lambda i, q, k, v: self_attention(q, k, v, self_kv.layers[i], start, scale),
            lambda i, q: attend(q, *cross[i], scale))
        self_kv.length = start + tokens.shape[0]
        return self.logits(x[-1:] if last_only else x)


def _first(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return next((t for t in tensors if t is not None), None)
