"""NomicBERT (nomic-embed-text v1 and v1.5) and GTE encoder math: plain tensors and
functional ops.

Checkpoint facts (transformers' ``modeling_nomic_bert.py`` and ``modeling_gte.py``, and their
renaming of the checkpoints' own tensor names): token (and, where configured, token-type)
embeddings then a LayerNorm, no position embeddings; post-norm layers (LayerNorm after each
residual add) whose q and k turn by rotary positions (rotate-half, one theta) before
attention; a gated FFN (``down(act(gate(x)) * up(x))``); NomicBERT without biases, GTE with
them on q, k, v, o and the down projection.

The hub's checkpoints name their tensors as their own code does. nomic's: ``emb_ln``,
``encoder.layers.{i}.attn.Wqkv``, ``mlp.fc11`` the up projection, ``mlp.fc12`` the gate,
``norm1``, ``norm2``. GTE's (``NewModel``): a ``new.`` prefix in a model with a head,
``encoder.layer.{i}.attention.qkv_proj``, ``attention.o_proj``, ``attn_ln``,
``mlp.up_gate_proj`` (up's rows, then the gate's), ``mlp_ln``. transformers saves them as its
models' (``layers.{i}.self_attn.q_proj``, ...). All of them load.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from heron.core.ops import pack_weight, packed_attention, rope_cos_sin_cache, rotary
from heron.plugins.bert.config import RopeEncoderConfig
from heron.plugins.bert.model import ACTIVATION_FNS, Dense, Layer, add_token_types
from heron.plugins.transformer.model import Weights

# the checkpoints' own names -> transformers' (q, k and v stay fused as `self_attn.qkv`)
_OWN_NAMES = [(r"^new\.", ""), (r"^emb_ln\.", "embeddings.LayerNorm."),
              (r"^encoder\.layers?\.", "layers."), (r"\.attn\.Wqkv\.", ".self_attn.qkv."),
              (r"\.attention\.qkv_proj\.", ".self_attn.qkv."),
              (r"\.(attn\.out_proj|attention\.o_proj)\.", ".self_attn.o_proj."),
              (r"\.mlp\.fc11\.", ".mlp.up_proj."), (r"\.mlp\.fc12\.", ".mlp.gate_proj."),
              (r"\.mlp\.fc2\.", ".mlp.down_proj."),
              (r"\.(norm1|attn_ln)\.", ".post_attention_layernorm."),
              (r"\.(norm2|mlp_ln)\.", ".post_mlp_layernorm.")]

def transformers_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in tensors.items():
        for pattern, new in _OWN_NAMES:
            name = re.sub(pattern, new, name)
        if ".mlp.up_gate_proj." in name:  # GTE's: the up projection's rows, then the gate's
            up, gate = tensor.chunk(2)
            renamed[name.replace("up_gate_proj", "up_proj")] = up
            name, tensor = name.replace("up_gate_proj", "gate_proj"), gate
        renamed[name] = tensor
    return renamed


class RopeEncoderModel:
    def __init__(self, cfg: RopeEncoderConfig, tensors: dict[str, torch.Tensor], device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = Weights(transformers_names(tensors), device, dtype)

        def dense(*names: str) -> Dense:
            return Dense(pack_weight(w.cat([f"{n}.weight" for n in names])),
                         w.cat([f"{n}.bias" for n in names], required=False))

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w.take(f"{name}.weight"), w.take(f"{name}.bias")

        def qkv(i: int) -> Dense:
            if f"layers.{i}.self_attn.qkv.weight" in w.tensors:
                return dense(f"layers.{i}.self_attn.qkv")
            return dense(*(f"layers.{i}.self_attn.{x}_proj" for x in "qkv"))

        self.tokens = w.take("embeddings.word_embeddings.weight")
        self.types = w.take("embeddings.token_type_embeddings.weight", cfg.type_vocab_size > 0)
        self.embed_norm = norm("embeddings.LayerNorm")
        # BERT's post-norm layer, its FFN's first projection the gate's rows then up's
        self.layers = [Layer(qkv(i), dense(f"layers.{i}.self_attn.o_proj"),
                             norm(f"layers.{i}.post_attention_layernorm"),
                             dense(f"layers.{i}.mlp.gate_proj", f"layers.{i}.mlp.up_proj"),
                             dense(f"layers.{i}.mlp.down_proj"),
                             norm(f"layers.{i}.post_mlp_layernorm"))
                       for i in range(cfg.num_layers)]
        self.cos_sin = rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta).to(device)
        self.head = None
        # a checkpoint's pooler or head (GTE's token classifier): what embedding does not read
        self.unused_tensors = [n for n in w.tensors if not n.startswith("pooler.")]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sizes: list[int],
                types: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of inputs of ``sizes`` tokens packed in
        ``ids``, at ``positions`` (each input's from 0), of token types ``types`` (None:
        all 0)."""
        cfg = self.cfg
        act, eps = ACTIVATION_FNS[cfg.hidden_act], cfg.layer_norm_eps
        attention = packed_attention(sizes, cfg.head_dim ** -0.5, ids.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(*rotary(q, k, positions, self.cos_sin), v)

        def gated(h: torch.Tensor) -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            return act(gate) * up

        x = add_token_types(self.tokens[ids], self.types, types)
        x = F.layer_norm(x, x.shape[-1:], *self.embed_norm, eps)
        for layer in self.layers:
            x = layer(x, attend, gated, eps, cfg.num_heads)
        return x
