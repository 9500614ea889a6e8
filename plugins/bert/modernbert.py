"""ModernBERT encoder math: plain tensors and functional ops, no nn.Module.

Checkpoint facts (transformers' ``modeling_modernbert.py``): a LayerNorm after the token
embeddings, pre-norm layers (the first has no attention norm), q/k/v fused in ``Wqkv``,
rotary positions (rotate-half) with one theta for global layers and another for local
ones, local layers attending within ``local_attention / 2`` positions either way, a GeGLU
FFN (``Wi``'s first half activated, times its second half), a final LayerNorm, and no
biases or norm biases unless configured. A classifier pools (``classifier_pooling``), then
``head.dense``, the classifier activation, ``head.norm`` and ``classifier``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.core import ScoreHead
from heron.core.ops import pack_weight, packed_attention, rope_cos_sin_cache, rotary
from heron.plugins.bert.config import ModernBertConfig
from heron.plugins.bert.model import ACTIVATION_FNS, Dense
from heron.plugins.transformer.model import Weights

Norm = tuple[torch.Tensor, torch.Tensor | None]


class ModernBertModel:
    def __init__(self, cfg: ModernBertConfig, tensors: dict[str, torch.Tensor], device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        # a model with a head keeps the encoder under "model."
        w = Weights({n.removeprefix("model."): t for n, t in tensors.items()}, device, dtype)

        def dense(name: str) -> Dense:
            return Dense(pack_weight(w.take(f"{name}.weight")), w.take(f"{name}.bias", False))

        def norm(name: str) -> Norm:
            return w.take(f"{name}.weight"), w.take(f"{name}.bias", False)

        self.tokens = w.take("embeddings.tok_embeddings.weight")
        self.embed_norm = norm("embeddings.norm")
        self.layers = [(norm(f"layers.{i}.attn_norm") if i else None,
                        dense(f"layers.{i}.attn.Wqkv"), dense(f"layers.{i}.attn.Wo"),
                        norm(f"layers.{i}.mlp_norm"), dense(f"layers.{i}.mlp.Wi"),
                        dense(f"layers.{i}.mlp.Wo")) for i in range(cfg.num_layers)]
        self.final_norm = norm("final_norm")
        self.cos_sin = {local: rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                  theta).to(device)
                        for local, theta in ((False, cfg.global_rope_theta),
                                             (True, cfg.local_rope_theta))}
        self.head = None
        if cfg.is_classifier:
            dense_weight, dense_bias = w.take("head.dense.weight"), w.take("head.dense.bias",
                                                                           False)
            self.head = ScoreHead(w.take("classifier.weight"), w.take("classifier.bias", False),
                                  (dense_weight, dense_bias), ACTIVATION_FNS[cfg.classifier_act],
                                  (*norm("head.norm"), cfg.norm_eps))
        # the masked-LM head of a checkpoint saved with one: what embedding does not read
        self.unused_tensors = [n for n in w.tensors if not n.startswith(("head.", "decoder."))]

    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], norm[0], norm[1], self.cfg.norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sizes: list[int],
                types: None = None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of inputs of ``sizes`` tokens packed in
        ``ids``, at ``positions`` (each input's from 0). ModernBERT has no token types."""
        cfg = self.cfg
        act = ACTIVATION_FNS[cfg.hidden_act]
        scale = cfg.head_dim ** -0.5
        attention = {False: packed_attention(sizes, scale, ids.device),
                     True: packed_attention(sizes, scale, ids.device, window=cfg.window)}
        x = self._norm(self.tokens[ids], self.embed_norm)
        for local, (attn_norm, qkv, out, mlp_norm, wi, wo) in zip(cfg.local_layers,
                                                                 self.layers):
            h = x if attn_norm is None else self._norm(x, attn_norm)
            q, k, v = qkv(h).view(x.shape[0], 3, cfg.num_heads, cfg.head_dim).unbind(1)
            q, k = rotary(q, k, positions, self.cos_sin[local])
            x = x + out(attention[local](q, k, v))
            gate_in, gate = wi(self._norm(x, mlp_norm)).chunk(2, dim=-1)
            x = x + wo(act(gate_in) * gate)
        return self._norm(x, self.final_norm)
