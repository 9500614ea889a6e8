"""BERT / RoBERTa / XLM-RoBERTa / DistilBERT encoder math: plain tensors and functional ops,
no nn.Module.

Checkpoint facts (transformers' ``modeling_bert.py``, ``modeling_roberta.py``,
``modeling_distilbert.py``): post-norm layers (LayerNorm after each residual add) with
biased projections, q scaled by ``head_dim ** -0.5``, learned absolute positions (RoBERTa's
from row ``pad_token_id + 1``) and token-type embeddings (not DistilBERT's) added to the
token's, then a LayerNorm. A classifier's head reads the first token: BERT's pooler (dense,
tanh) then ``classifier``; RoBERTa's ``classifier.dense``, tanh, ``classifier.out_proj``;
DistilBERT's ``pre_classifier``, ReLU, ``classifier``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.core import ScoreHead
from heron.core.ops import linear, pack_weight, packed_attention
from heron.plugins.bert.config import EncoderConfig
from heron.plugins.transformer.model import Weights

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATION_FNS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu,
                  "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "tanh": torch.tanh}


@dataclass
class Dense:
    weight: torch.Tensor  # [out, in], `pack_weight`-ed
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass
class Layer:
    """A post-norm encoder layer (BERT's; DeBERTa's around its own attention; NomicBERT's
    and GTE's around rotary attention and a gated FFN)."""

    qkv: Dense  # q, k, v rows fused
    attn_out: Dense
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up: Dense  # a gated FFN's: the gate's rows, then up's (its `act` multiplies them)
    down: Dense
    ffn_norm: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def load(cls, w: Weights, prefix: str, qkv: tuple[str, str, str]) -> Layer:
        """Layer ``prefix`` (``encoder.layer.{i}.``), its projections ``qkv`` named."""
        def dense(name: str) -> Dense:
            return Dense(pack_weight(w.take(f"{name}.weight")), w.take(f"{name}.bias"))

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w.take(f"{name}.LayerNorm.weight"), w.take(f"{name}.LayerNorm.bias")

        names = [f"{prefix}attention.self.{x}" for x in qkv]
        return cls(qkv=Dense(pack_weight(w.cat([f"{n}.weight" for n in names])),
                             w.cat([f"{n}.bias" for n in names])),
                   attn_out=dense(f"{prefix}attention.output.dense"),
                   attn_norm=norm(f"{prefix}attention.output"),
                   up=dense(f"{prefix}intermediate.dense"),
                   down=dense(f"{prefix}output.dense"),
                   ffn_norm=norm(f"{prefix}output"))

    def __call__(self, x: torch.Tensor, attend, act, eps: float, num_heads: int
                 ) -> torch.Tensor:
        """``attend(q, k, v)``: ``[T, heads, head_dim]`` each in, ``[T, hidden]`` out;
        ``act`` of the FFN's first projection gives the input of its second."""
        qkv = self.qkv(x).view(x.shape[0], 3, num_heads, -1)
        o = self.attn_out(attend(qkv[:, 0], qkv[:, 1], qkv[:, 2]))
        x = F.layer_norm(o + x, x.shape[-1:], *self.attn_norm, eps)
        h = self.down(act(self.up(x)))
        return F.layer_norm(h + x, x.shape[-1:], *self.ffn_norm, eps)


def add_token_types(x: torch.Tensor, table: torch.Tensor | None,
                    types: torch.Tensor | None) -> torch.Tensor:
    """``x`` plus each row's token-type embedding from ``table`` (``types`` None: type 0);
    ``x`` itself for a model without token types (``table`` None)."""
    if table is None:
        return x
    return x + (table[0] if types is None else table[types])


# DistilBERT's names for BERT's layer tensors
_DISTILBERT_NAMES = [("transformer.layer.", "encoder.layer."),
                     ("attention.q_lin.", "attention.self.query."),
                     ("attention.k_lin.", "attention.self.key."),
                     ("attention.v_lin.", "attention.self.value."),
                     ("attention.out_lin.", "attention.output.dense."),
                     ("sa_layer_norm.", "attention.output.LayerNorm."),
                     ("ffn.lin1.", "intermediate.dense."), ("ffn.lin2.", "output.dense."),
                     ("output_layer_norm.", "output.LayerNorm.")]


def checkpoint_names(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors named as a bare BERT encoder's (``embeddings.``, ``encoder.``): without
    the ``bert.`` / ``roberta.`` / ``distilbert.`` prefix a model with a head saves them
    under, with old checkpoints' LayerNorm ``gamma`` / ``beta`` called ``weight`` /
    ``bias``, and DistilBERT's layer tensors under BERT's names."""
    def name(n: str) -> str:
        n = n.removeprefix(prefix + ".")
        if prefix == "distilbert":
            for old, new in _DISTILBERT_NAMES:
                n = n.replace(old, new)
        return n.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta",
                                                                          "LayerNorm.bias")
    return {name(n): t for n, t in tensors.items()}


class EncoderModel:
    def __init__(self, cfg: EncoderConfig, tensors: dict[str, torch.Tensor], device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = Weights(checkpoint_names(tensors, cfg.prefix), device, dtype)
        self.tokens = w.take("embeddings.word_embeddings.weight")
        self.positions = w.take("embeddings.position_embeddings.weight")
        self.types = w.take("embeddings.token_type_embeddings.weight", cfg.type_vocab_size > 0)
        self.embed_norm = (w.take("embeddings.LayerNorm.weight"),
                           w.take("embeddings.LayerNorm.bias"))
        self.layers = [Layer.load(w, f"encoder.layer.{i}.", ("query", "key", "value"))
                       for i in range(cfg.num_layers)]
        self.head = score_head(w, cfg.prefix) if cfg.is_classifier else None
        # a bare encoder's pooler (BERT's) and position-id buffers: what embedding does not read
        self.unused_tensors = [n for n in w.tensors
                               if not n.startswith("pooler.") and not n.endswith("_ids")]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sizes: list[int],
                types: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of inputs of ``sizes`` tokens packed in
        ``ids``, at ``positions`` (each input's from 0), of token types ``types`` (None:
        all 0)."""
        cfg = self.cfg
        eps, act = cfg.layer_norm_eps, ACTIVATION_FNS[cfg.hidden_act]
        attention = packed_attention(sizes, cfg.head_dim ** -0.5, ids.device)
        x = self.tokens[ids] + self.positions[positions + cfg.position_offset]
        x = add_token_types(x, self.types, types)
        x = F.layer_norm(x, x.shape[-1:], *self.embed_norm, eps)
        for layer in self.layers:
            x = layer(x, attention, act, eps, cfg.num_heads)
        return x


def score_head(w: Weights, prefix: str) -> ScoreHead:
    if prefix == "bert":  # its pooler, then the classifier
        return ScoreHead(w.take("classifier.weight"), w.take("classifier.bias"),
                         (w.take("pooler.dense.weight"), w.take("pooler.dense.bias")))
    if prefix == "distilbert":
        return ScoreHead(w.take("classifier.weight"), w.take("classifier.bias"),
                         (w.take("pre_classifier.weight"), w.take("pre_classifier.bias")),
                         F.relu)
    return ScoreHead(w.take("classifier.out_proj.weight"), w.take("classifier.out_proj.bias"),
                     (w.take("classifier.dense.weight"), w.take("classifier.dense.bias")))
