"""DeBERTa-v2 / -v3 encoder math: plain tensors and functional ops, no nn.Module.

Checkpoint facts (transformers' ``modeling_deberta_v2.py``): BERT's post-norm layers
(``query_proj``, ``key_proj``, ``value_proj``), embeddings of the token (projected by
``embed_proj`` where ``embedding_size`` differs), plus absolute positions and token types
only where configured, then a LayerNorm. Attention scores add, to ``q . k``, the query
against the key's relative position (c2p: ``q . Kr[delta]``) and the key against the
query's (p2c: ``k . Qr[-delta]``), ``delta = i - j`` bucketed on a log scale past
``position_buckets / 2``, all over ``sqrt(head_dim * (1 + terms))``; ``Kr`` and ``Qr`` are
the (LayerNorm-ed) ``encoder.rel_embeddings`` through the key and query projections
(``share_att_key``) or their own ``pos_key_proj`` / ``pos_query_proj``. A classifier's
``pooler.dense`` and activation read the first token, then ``classifier``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from heron.core import ScoreHead
from heron.core.ops import linear, pack_weight, packed_attention
from heron.plugins.bert.config import DebertaConfig
from heron.plugins.bert.model import (ACTIVATION_FNS, Layer, add_token_types,
                                      checkpoint_names)
from heron.plugins.transformer.model import Weights


def relative_positions(n: int, buckets: int, max_relative: int) -> torch.Tensor:
    """``[n, n]`` int64: ``i - j`` for query ``i`` and key ``j``, beyond ``buckets / 2`` on
    DeBERTa's log buckets (float32 arithmetic, as the checkpoints were trained with)."""
    delta = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    if not buckets:
        return delta
    mid = buckets // 2
    size = torch.where(delta.abs() < mid, torch.tensor(mid - 1), delta.abs())
    scale = torch.log(torch.tensor((max_relative - 1) / mid))
    log_bucket = torch.ceil(torch.log(size / mid) / scale * (mid - 1)) + mid
    return torch.where(size <= mid, delta.float(), log_bucket * torch.sign(delta)).long()


class DebertaModel:
    def __init__(self, cfg: DebertaConfig, tensors: dict[str, torch.Tensor], device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        w = Weights(checkpoint_names(tensors, "deberta"), device, dtype)
        self.tokens = w.take("embeddings.word_embeddings.weight")
        self.positions = w.take("embeddings.position_embeddings.weight", cfg.absolute_positions)
        self.types = w.take("embeddings.token_type_embeddings.weight", cfg.type_vocab_size > 0)
        self.embed_proj = None
        if cfg.embedding_size != cfg.hidden_size:
            self.embed_proj = pack_weight(w.take("embeddings.embed_proj.weight"))
        self.embed_norm = (w.take("embeddings.LayerNorm.weight"),
                           w.take("embeddings.LayerNorm.bias"))
        # before the layers take the projections that shared keys read
        self.position_keys, self.position_queries = self._relative_tables(w)
        self.layers = [Layer.load(w, f"encoder.layer.{i}.",
                                  ("query_proj", "key_proj", "value_proj"))
                       for i in range(cfg.num_layers)]
        self.head = None
        if cfg.is_classifier:
            self.head = ScoreHead(w.take("classifier.weight"), w.take("classifier.bias"),
                                  (w.take("pooler.dense.weight"), w.take("pooler.dense.bias")),
                                  ACTIVATION_FNS[cfg.pooler_act])
        # a masked-LM head and position-id buffers: what embedding does not read
        self.unused_tensors = [n for n in w.tensors
                               if not n.startswith(("lm_predictions.", "mask_predictions."))
                               and not n.endswith("_ids")]

    def _relative_tables(self, w: Weights) -> tuple[list, list]:
        """Each layer's relative-position keys (for c2p) and queries (for p2c), ``[heads,
        2 * span, head_dim]`` or None: weights through weights, so computed once."""
        cfg = self.cfg
        none = [None] * cfg.num_layers
        if not cfg.relative_attention:
            return none, none
        table = w.take("encoder.rel_embeddings.weight").float()[:2 * cfg.span]
        if cfg.norm_rel_embeddings:
            norm = [w.take(f"encoder.LayerNorm.{p}").float() for p in ("weight", "bias")]
            table = F.layer_norm(table, table.shape[-1:], *norm, cfg.layer_norm_eps)

        def project(layer: int, kind: str) -> torch.Tensor:
            name = f"encoder.layer.{layer}.attention.self.{kind}_proj"
            if cfg.share_att_key:  # the content projection, which the layer takes later
                weight, bias = (w.tensors[f"{name}.{p}"] for p in ("weight", "bias"))
            else:
                name = name.replace(f"{kind}_proj", f"pos_{kind}_proj")
                weight, bias = (w.take(f"{name}.{p}") for p in ("weight", "bias"))
            rows = F.linear(table, weight.to(table), bias.to(table))
            rows = rows.view(len(table), cfg.num_heads, cfg.head_dim).transpose(0, 1)
            return rows.contiguous().to(self.tokens.dtype)

        return ([project(i, "key") if cfg.c2p else None for i in range(cfg.num_layers)],
                [project(i, "query") if cfg.p2c else None for i in range(cfg.num_layers)])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sizes: list[int],
                types: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of inputs of ``sizes`` tokens packed in
        ``ids``, at ``positions`` (each input's from 0), of token types ``types`` (None:
        all 0)."""
        cfg = self.cfg
        x = self.tokens[ids]
        if self.positions is not None:
            x = x + self.positions[positions]
        x = add_token_types(x, self.types, types)
        if self.embed_proj is not None:
            x = linear(x, self.embed_proj)
        x = F.layer_norm(x, x.shape[-1:], *self.embed_norm, cfg.layer_norm_eps)
        # every score term (q . k, c2p, p2c) over sqrt(head_dim * terms)
        scale = (cfg.head_dim * (1 + cfg.c2p + cfg.p2c)) ** -0.5
        attention = packed_attention(sizes, scale, ids.device)
        biases = self._position_biases(max(sizes), scale, ids.device)
        act = ACTIVATION_FNS[cfg.hidden_act]
        for layer, bias in zip(self.layers, biases):
            attend = attention if bias is None else partial(attention, bias=bias)
            x = layer(x, attend, act, cfg.layer_norm_eps, cfg.num_heads)
        return x

    def _position_biases(self, longest: int, scale: float, device: torch.device) -> list:
        """Per layer, ``bias(q, k)`` (`packed_attention`'s) of its relative positions, or
        None without relative attention."""
        cfg = self.cfg
        if not (cfg.relative_attention and (cfg.c2p or cfg.p2c)):
            return [None] * cfg.num_layers
        delta = relative_positions(longest, cfg.position_buckets,
                                   cfg.max_relative_positions).to(device)
        # only the table's rows these distances reach: [first, last]; short inputs read few
        span, reach = cfg.span, int(delta.abs().max())
        first, last = max(span - reach, 0), min(span + reach, 2 * span - 1)
        key_rows = (delta + span).clamp(0, 2 * span - 1) - first
        query_rows = (span - delta).clamp(0, 2 * span - 1) - first

        def bias_of(keys: torch.Tensor | None, queries: torch.Tensor | None):
            def bias(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # [S, H, L, D] each
                shape = (*q.shape[:2], longest, longest)
                total = 0
                if keys is not None:  # query i against key j's position: row delta[i, j]
                    rows = keys[:, first:last + 1].transpose(-1, -2)
                    total = torch.gather(q @ rows, -1, key_rows.expand(shape))
                if queries is not None:  # key j against query i's: row -delta[j, i]
                    rows = queries[:, first:last + 1].transpose(-1, -2)
                    total = total + torch.gather(k @ rows, -1,
                                                 query_rows.expand(shape)).transpose(-1, -2)
                return total * scale
            return bias

        return [bias_of(k, q) for k, q in zip(self.position_keys, self.position_queries)]
