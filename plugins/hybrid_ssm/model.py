"""Mamba2 and Mamba2/attention hybrids (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1) over
paged KV for the attention layers and engine state slots for the Mamba layers.

Plain tensors and functional ops, no nn.Module. Every layer is one or two pre-norm residual
blocks: a mixer (Mamba2, attention, or both summed) and a feed-forward (MLP or MoE).
Attention and the SwiGLU MLP are the transformer family's own functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.core.batch import Batch
from heron.core.cache_spec import CacheTensors
from heron.core.ops import linear, rms_norm, rope_cos_sin_cache
from heron.plugins.hybrid_ssm.config import HybridConfig
from heron.plugins.hybrid_ssm.ffn import MoeWeights, mlp, moe
from heron.plugins.hybrid_ssm.mixer import MambaPlan, mamba_mixer
from heron.plugins.hybrid_ssm.weights import HybridLayer, ScaledWeights, load_layers
from heron.plugins.transformer.model import AttentionShape, attention

CONV_STATE, SSM_STATE = "conv", "ssm"


class HybridModel:
    def __init__(self, cfg: HybridConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = ScaledWeights(dict(tensors), device, dtype)
        self.embed, self.layers, self.final_norm, self.lm_head = load_layers(w, cfg)
        self.unused_tensors = sorted(w.tensors)
        # NOTE: the KV cache and the state tensors hold only the layers that use them
        self.kv_index = {layer: j for j, layer in enumerate(cfg.attention_layers)}
        self.state_index = {layer: j for j, layer in enumerate(cfg.mamba_layers)}
        a = cfg.attention
        self.attn_shape = (AttentionShape(a.num_heads, a.num_kv_heads, a.head_dim, a.scale)
                           if a is not None else None)
        self.cos_sin = None
        if a is not None and a.rope_dim and self.kv_index:
            self.cos_sin = rope_cos_sin_cache(a.rope_dim, cfg.max_position_embeddings,
                                              a.rope_theta, a.rope_scaling).to(device)

    def forward(self, batch: Batch, cache: CacheTensors,
                hidden_out: list[torch.Tensor] | None = None,
                hidden_layers: tuple[int | None, ...] = (None,)) -> torch.Tensor:
        """Logits (float32) for ``batch.logits_indices``; writes the KV of every token of the
        attention layers and leaves each sequence's slot holding its state after its last row.
        ``hidden_out``: a list that receives, for a drafter that reads them, the hidden
        states of every row after each of ``hidden_layers`` (None: the final ones, after
        the last norm; ``n``: layer ``n``'s output, counted from 1, through the same norm)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        taps = {}
        x = F.embedding(batch.input_ids, self.embed)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        plan = MambaPlan.build(batch, cfg.mamba.clamps_dt) if self.state_index else None
        residual = None
        for i, layer in enumerate(self.layers):
            for norm, block in ((layer.norm, self._mixer), (layer.ffn_norm, self._ffn)):
                if norm is None:
                    continue
                if residual is None:
                    residual = x
                    h, _ = rms_norm(x, norm, eps)
                else:
                    h, residual = rms_norm(x, norm, eps, residual)
                x = block(i, layer, h, batch, cache, plan)
            if hidden_out is not None and i + 1 in hidden_layers:
                taps[i + 1] = rms_norm(x, self.final_norm, eps, residual)[0]
        rows = batch.logits_indices
        if hidden_out is not None:
            h, _ = rms_norm(x, self.final_norm, eps, residual)
            hidden_out.extend(h if n is None else taps[n] for n in hidden_layers)
            h = h.index_select(0, rows)
        else:
            h, _ = rms_norm(x.index_select(0, rows), self.final_norm, eps,
                            residual.index_select(0, rows))
        logits = linear(h, self.lm_head)
        if cfg.logits_multiplier != 1.0:
            logits = logits * cfg.logits_multiplier
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        return logits.float()

    def _mixer(self, i: int, layer: HybridLayer, h: torch.Tensor, batch: Batch,
               cache: CacheTensors, plan: MambaPlan | None) -> torch.Tensor:
        out = None
        if layer.mamba is not None:
            j = self.state_index[i]
            out = mamba_mixer(h, layer.mamba, self.cfg.mamba, plan,
                              cache.states[CONV_STATE][:, j], cache.states[SSM_STATE][:, j])
        if layer.attn is not None:
            a = attention(h, layer.attn, self.attn_shape, batch, cache.layer_kv(self.kv_index[i]),
                          self.cos_sin)
            out = a if out is None else out + a
        return out

    def _ffn(self, i: int, layer: HybridLayer, h: torch.Tensor, batch: Batch,
             cache: CacheTensors, plan: MambaPlan | None) -> torch.Tensor:
        if isinstance(layer.ffn, MoeWeights):
            return moe(h, layer.ffn, self.cfg.moe)
        return mlp(h, layer.ffn)
