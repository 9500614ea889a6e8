"""Decoder-only transformer math (Llama / Mistral / Granite / OLMo 2 and 3 / Phi-3 / Qwen2 /
Qwen3 / SmolLM3) over paged KV.

Plain tensors and functional ops, no nn.Module: the weights are fused at load time
(q/k/v into one projection, gate/up into one) so each layer is four matmuls.
`attention` and `gated_mlp` are module-level so other families (hybrid_ssm) reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core.batch import Batch
from heron.core.cache_spec import CacheTensors
from heron.core.ops import (
    linear, pack_weight, paged_attention, rms_norm, rope_cos_sin_cache, rotary, rotary_write_kv,
    silu_and_mul, write_kv)
from heron.core.ops.linear import unpack_weight
from heron.core.ops.lora import LayerLora, layer_loras
from heron.core.ops.quantized import KeptWeight, QuantizedWeight
from heron.core.pooling import ScoreHead
from heron.plugins.transformer.config import TransformerConfig


@dataclass
class AttentionWeights:
    qkv: torch.Tensor               # [(Hq + 2 Hkv) D, hidden]: q, k, v rows fused
    o: torch.Tensor                 # [hidden, Hq D]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    # RMSNorm before rotary: per head, [D] (Qwen3), or over all heads, [H D] (OLMo 2)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float = 1e-6  # of the q/k norms

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None where the norms come after (OLMo 2)
    attn: AttentionWeights
    post_norm: torch.Tensor  # before the MLP, or on the attention's output (OLMo 2)
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    mlp_norm: torch.Tensor | None = None  # on the MLP's output (OLMo 2)


class Weights:
    """Pops tensors by HF name, so leftovers can be reported and missing ones named."""

    def __init__(self, tensors: dict[str, torch.Tensor], device, dtype) -> None:
        self.tensors, self.device, self.dtype = tensors, device, dtype

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self.tensors.pop(name, None)
        if t is None:
            if required:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return None
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, names: list[str], required: bool = True) -> torch.Tensor | KeptWeight | None:
        """The tensors' rows one after another; quantized ones stay so (`QuantizedWeight.cat`)
        where all are and share a width (else all are dequantized)."""
        parts = [self.take(n, required) for n in names]
        if any(p is None for p in parts):
            return None
        if any(isinstance(p, QuantizedWeight) for p in parts):
            if all(isinstance(p, QuantizedWeight) for p in parts) and (
                    fused := QuantizedWeight.cat(parts)) is not None:
                return fused
            parts = [unpack_weight(p) for p in parts]
        return torch.cat(parts, dim=0).contiguous()


def qkv_heads(h: torch.Tensor, w: AttentionWeights, shape: AttentionShape,
              positions: torch.Tensor, cos_sin: torch.Tensor | None,
              lora: LayerLora | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D], k, v [T, Hkv, D]`` of ``h [T, hidden]`` at ``positions``: qkv →
    (q/k norm) → rotary (``cos_sin`` None: no position embedding)."""
    num_tokens = h.shape[0]
    qkv = linear(h, w.qkv, w.qkv_bias)
    if lora is not None:
        q_end, k_end = shape.q_size, shape.q_size + shape.kv_size
        lora.apply("q_proj", h, qkv[:, :q_end])
        lora.apply("k_proj", h, qkv[:, q_end:k_end])
        lora.apply("v_proj", h, qkv[:, k_end:])
    # one view and one split rather than a split and three views: a decode step runs this
    # once a layer, and on the CPU each torch call costs microseconds
    q, k, v = qkv.view(num_tokens, -1, shape.head_dim).split_with_sizes(
        [shape.num_heads, shape.num_kv_heads, shape.num_kv_heads], dim=1)
    if w.q_norm is not None and len(w.q_norm) == shape.head_dim:
        q, _ = rms_norm(q, w.q_norm, shape.eps)
        k, _ = rms_norm(k, w.k_norm, shape.eps)
    elif w.q_norm is not None:  # over all heads
        q = rms_norm(q.reshape(num_tokens, -1), w.q_norm, shape.eps)[0].view(q.shape)
        k = rms_norm(k.reshape(num_tokens, -1), w.k_norm, shape.eps)[0].view(k.shape)
    if cos_sin is not None:
        q, k = rotary(q, k, positions, cos_sin)
    return q, k, v


def attention(h: torch.Tensor, w: AttentionWeights, shape: AttentionShape, batch: Batch,
              kv: tuple[torch.Tensor, torch.Tensor],
              cos_sin: torch.Tensor | None, lora: LayerLora | None = None) -> torch.Tensor:
    """Self-attention of ``h [T, hidden]`` over paged KV: `qkv_heads` → rotary with the write
    of this step's K/V into ``kv = (k_cache, v_cache)`` (one op) → paged attention → o.
    ``cos_sin`` None: no position embedding (NoPE layers). ``lora``: adapter deltas for the
    projections. Returns ``[T, hidden]``."""
    num_tokens = h.shape[0]
    q, k, v = qkv_heads(h, w, shape, batch.positions, None, lora)  # rotary goes with the write
    k_cache, v_cache = kv
    if cos_sin is None:
        write_kv(k, v, k_cache, v_cache, batch.attn.slot_mapping)
    else:
        q = rotary_write_kv(q, k, v, batch.positions, cos_sin, k_cache, v_cache,
                            batch.attn.slot_mapping)
    o = paged_attention(q, k_cache, v_cache, batch.attn, shape.scale)
    o = o.reshape(num_tokens, shape.q_size)
    out = linear(o, w.o, w.o_bias)
    if lora is not None:
        lora.apply("o_proj", o, out)
    return out


def gated_mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None,
              lora: LayerLora | None = None) -> torch.Tensor:
    """SwiGLU MLP: ``down(silu(gate(h)) * up(h))`` with gate/up fused (gate rows first);
    ``lora``: adapter deltas for the three projections."""
    gu = linear(h, gate_up, gate_up_bias)
    if lora is not None:
        inter = gu.shape[1] // 2
        lora.apply("gate_proj", h, gu[:, :inter])
        lora.apply("up_proj", h, gu[:, inter:])
    act = silu_and_mul(gu)
    out = linear(act, down, down_bias)
    if lora is not None:
        lora.apply("down_proj", act, out)
    return out


def load_layer(w: Weights, p: str, cfg: TransformerConfig) -> LayerWeights:
    """The decoder layer whose HF tensors start with ``p`` (``model.layers.3.``); q/k/v and
    gate/up come apart, or fused already (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv_names = [attn + f"{n}_proj" for n in "qkv"]
    if attn + "qkv_proj.weight" in w.tensors:
        qkv_names = [attn + "qkv_proj"]
    gate_up_names = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
    if mlp + "gate_up_proj.weight" in w.tensors:
        gate_up_names = [mlp + "gate_up_proj.weight"]
    return LayerWeights(
        input_norm=None if cfg.norms_after else w.take(p + "input_layernorm.weight"),
        attn=AttentionWeights(
            qkv=pack_weight(w.cat([n + ".weight" for n in qkv_names])),
            qkv_bias=w.cat([n + ".bias" for n in qkv_names]) if cfg.qkv_bias else None,
            o=pack_weight(w.take(attn + "o_proj.weight")),
            o_bias=w.take(attn + "o_proj.bias") if cfg.o_bias else None,
            q_norm=w.take(attn + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=w.take(attn + "k_norm.weight") if cfg.qk_norm else None),
        post_norm=w.take(p + "post_attention_layernorm.weight"),
        gate_up=pack_weight(w.cat(gate_up_names)),
        gate_up_bias=(w.cat([mlp + "gate_proj.bias", mlp + "up_proj.bias"])
                      if cfg.mlp_bias else None),
        down=pack_weight(w.take(mlp + "down_proj.weight")),
        down_bias=w.take(mlp + "down_proj.bias") if cfg.mlp_bias else None,
        mlp_norm=w.take(p + "post_feedforward_layernorm.weight") if cfg.norms_after else None,
    )


class TransformerModel:
    def __init__(self, cfg: TransformerConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = Weights(dict(tensors), device, dtype)
        self.embed = w.take("model.embed_tokens.weight")
        self.layers = [load_layer(w, f"model.layers.{i}.", cfg) for i in range(cfg.num_layers)]
        self.final_norm = w.take("model.norm.weight")
        lm_head = w.take("lm_head.weight",
                         required=cfg.has_lm_head and not cfg.tie_word_embeddings)
        if lm_head is None and cfg.tie_word_embeddings:
            lm_head = self.embed
        self.lm_head = pack_weight(lm_head)  # None: a bare model, which only embeds
        # a classifier's score head, which the engine's pooler applies
        self.classifier = ScoreHead(w.take("score.weight")) if cfg.has_score_head else None
        self.cos_sin = rope_cos_sin_cache(cfg.rotary_dim or cfg.head_dim,
                                          cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling).to(device)
        local = (rope_cos_sin_cache(cfg.rotary_dim or cfg.head_dim,
                                    cfg.max_position_embeddings, *cfg.local_rope).to(device)
                 if cfg.local_rope_layers else None)
        self.layer_cos_sin = [None if i in cfg.nope_layers else
                              local if i in cfg.local_rope_layers else self.cos_sin
                              for i in range(cfg.num_layers)]
        self.shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.attention_multiplier or cfg.head_dim ** -0.5,
                                    cfg.rms_norm_eps)
        self.unused_tensors = sorted(k for k in w.tensors if "rotary_emb" not in k)

    def forward(self, batch: Batch, cache: CacheTensors,
                hidden_out: list[torch.Tensor] | None = None,
                hidden_layers: tuple[int | None, ...] = (None,)) -> torch.Tensor:
        """Logits (float32) for ``batch.logits_indices``; writes every token's KV.
        ``hidden_out``: a list that receives, for a drafter that reads them, the hidden
        states of every row after each of ``hidden_layers`` (None: the final ones, after
        the last norm; ``n``: layer ``n``'s output, counted from 1, through the same norm)."""
        eps = self.cfg.rms_norm_eps
        taps = {}
        x = F.embedding(batch.input_ids, self.embed)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        residual_scale = self.cfg.residual_multiplier
        loras = layer_loras(cache.lora, cache.lora_scaling, batch.lora_slots,
                            batch.lora_groups, len(self.layers))
        residual = None
        for i, layer in enumerate(self.layers):
            if layer.input_norm is None:  # norms after (OLMo 2): x is the whole stream
                h = attention(x, layer.attn, self.shape, batch, cache.layer_kv(i),
                              self.layer_cos_sin[i], loras[i])
                x = x + rms_norm(h, layer.post_norm, eps)[0]
                h = gated_mlp(x, layer.gate_up, layer.down, layer.gate_up_bias,
                              layer.down_bias, loras[i])
                x = x + rms_norm(h, layer.mlp_norm, eps)[0]
            else:  # x is a layer's output, which the next norm adds to residual
                if residual is None:
                    residual = x
                    h, _ = rms_norm(x, layer.input_norm, eps)
                else:
                    h, residual = rms_norm(x, layer.input_norm, eps, residual)
                x = attention(h, layer.attn, self.shape, batch, cache.layer_kv(i),
                              self.layer_cos_sin[i], loras[i])
                if residual_scale != 1.0:
                    x = x * residual_scale
                h, residual = rms_norm(x, layer.post_norm, eps, residual)
                x = gated_mlp(h, layer.gate_up, layer.down, layer.gate_up_bias,
                              layer.down_bias, loras[i])
                if residual_scale != 1.0:
                    x = x * residual_scale
            if hidden_out is not None and i + 1 in hidden_layers:
                taps[i + 1] = rms_norm(x, self.final_norm, eps, residual)[0]
        rows = batch.logits_indices
        if hidden_out is not None:
            h, _ = rms_norm(x, self.final_norm, eps, residual)
            hidden_out.extend(h if n is None else taps[n] for n in hidden_layers)
            return self._logits(h.index_select(0, rows))
        h, _ = rms_norm(x.index_select(0, rows), self.final_norm, eps,
                        None if residual is None else residual.index_select(0, rows))
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            if h.shape[0]:
                raise ValueError("a model without an LM head serves embeddings or labels only")
            return h.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        logits = linear(h, self.lm_head).float()
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling
