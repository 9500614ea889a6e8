"""Decoder-only transformer math (Llama / Mistral / Qwen2 / Qwen3) over paged KV.

Plain tensors and functional ops, no nn.Module: the weights are fused at load time
(q/k/v into one projection, gate/up into one) so each layer is four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core.batch import Batch
from heron.core.cache_spec import CacheTensors
from heron.core.ops import paged_attention, rms_norm, rope_cos_sin_cache, rotary, silu_and_mul, write_kv
from heron.plugins.transformer.config import TransformerConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class _Weights:
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

    def cat(self, names: list[str], required: bool = True) -> torch.Tensor | None:
        parts = [self.take(n, required) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0).contiguous()


class TransformerModel:
    def __init__(self, cfg: TransformerConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = _Weights(dict(tensors), device, dtype)
        self.embed = w.take("model.embed_tokens.weight")
        self.layers = [self._layer(w, f"model.layers.{i}.") for i in range(cfg.num_layers)]
        self.final_norm = w.take("model.norm.weight")
        lm_head = w.take("lm_head.weight", required=not cfg.tie_word_embeddings)
        self.lm_head = lm_head if lm_head is not None else self.embed
        self.cos_sin = rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling).to(device)
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.unused_tensors = sorted(k for k in w.tensors if "rotary_emb" not in k)

    def _layer(self, w: _Weights, p: str) -> LayerWeights:
        cfg = self.cfg
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_names = [attn + f"{n}_proj" for n in "qkv"]
        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight"),
            qkv=w.cat([n + ".weight" for n in qkv_names]),
            qkv_bias=w.cat([n + ".bias" for n in qkv_names]) if cfg.qkv_bias else None,
            o=w.take(attn + "o_proj.weight"),
            o_bias=w.take(attn + "o_proj.bias") if cfg.o_bias else None,
            q_norm=w.take(attn + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=w.take(attn + "k_norm.weight") if cfg.qk_norm else None,
            post_norm=w.take(p + "post_attention_layernorm.weight"),
            gate_up=w.cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
            gate_up_bias=(w.cat([mlp + "gate_proj.bias", mlp + "up_proj.bias"])
                          if cfg.mlp_bias else None),
            down=w.take(mlp + "down_proj.weight"),
            down_bias=w.take(mlp + "down_proj.bias") if cfg.mlp_bias else None,
        )

    def forward(self, batch: Batch, cache: CacheTensors) -> torch.Tensor:
        """Logits (float32) for ``batch.logits_indices``; writes every token's KV."""
        eps = self.cfg.rms_norm_eps
        x = F.embedding(batch.input_ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = x
                h, _ = rms_norm(x, layer.input_norm, eps)
            else:
                h, residual = rms_norm(x, layer.input_norm, eps, residual)
            x = self._attention(i, layer, h, batch, cache)
            h, residual = rms_norm(x, layer.post_norm, eps, residual)
            x = F.linear(silu_and_mul(F.linear(h, layer.gate_up, layer.gate_up_bias)),
                         layer.down, layer.down_bias)
        rows = batch.logits_indices
        h, _ = rms_norm(x.index_select(0, rows), self.final_norm, eps,
                        residual.index_select(0, rows))
        return F.linear(h, self.lm_head).float()

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, batch: Batch,
                   cache: CacheTensors) -> torch.Tensor:
        cfg, eps, num_tokens = self.cfg, self.cfg.rms_norm_eps, h.shape[0]
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q, _ = rms_norm(q, layer.q_norm, eps)
            k, _ = rms_norm(k, layer.k_norm, eps)
        q, k = rotary(q, k, batch.positions, self.cos_sin)
        k_cache, v_cache = cache.layer_kv(i)
        write_kv(k, v, k_cache, v_cache, batch.attn.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, batch.attn, self.scale)
        return F.linear(o.reshape(num_tokens, self.q_size), layer.o, layer.o_bias)
