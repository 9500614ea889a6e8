"""Multi-token-prediction (MTP) weights, in the two layouts checkpoints ship them in.

DeepSeek-V3 (and GLM-4.5) store the MTP module as one more decoder layer after the last,
``model.layers.{N}.`` with ``N`` the target's layer count: ``enorm`` (for the embedding of
the next token), ``hnorm`` (for the target's hidden state), ``eh_proj`` ([hidden, 2 hidden],
over ``[enorm(embedding), hnorm(hidden)]``), the decoder layer's own tensors, and
``shared_head.norm`` / ``shared_head.head`` (``embed_tokens`` and ``shared_head.head``
may be left out: then the target's are shared).

Qwen3-Next stores it under ``mtp.``: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``fc``, ``layers.0.``, ``norm``; the embedding and LM head are always the target's, and its
RMSNorm weights are zero-centred (the scale is ``1 + w``).

heron's extension, written by ``heron train-mtp``: ``{prefix}draft_token_ids`` (int64
``[V']``) restricts drafting to a frequency-ranked subset of the vocabulary; the head's rows
(``shared_head.head``, or the target's head when absent) are then those tokens' only. On a
CPU the full LM head costs a quarter of a small model's decode step; a few thousand rows
cost almost nothing, and the tokens outside them are rarely the next one. And
``{prefix}hidden_layer`` (int64 scalar ``n``): the head reads the output of the target's layer
``n`` (through the target's final norm) instead of its final hidden state. A middle layer
still says which token each position holds, which one attention layer needs to copy text
from the prompt; the last layer mostly says what comes next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from heron.core.checkpoint import load_safetensors, safetensors_files
from heron.core.ops import pack_weight
from heron.core.ops.linear import unpack_weight
from heron.plugins.transformer.model import (AttentionShape, LayerWeights, TransformerModel,
                                              Weights, load_layer)

_DEEPSEEK = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


@dataclass(frozen=True)
class LayerFlags:
    """The biases and norms an MTP decoder layer has (what `load_layer` reads)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    norms_after: bool = False  # an MTP layer norms its inputs, whatever its target does


@dataclass
class DraftTarget:
    """What an MTP head shares with its target model (embedding, LM head) and takes from
    it (attention shape, rotary table, norm epsilon, biases)."""

    embed: torch.Tensor             # [vocab, hidden]
    lm_head: torch.Tensor           # packed
    tied: bool
    num_layers: int
    eps: float
    shape: AttentionShape
    cos_sin: torch.Tensor | None    # None: no position embedding
    flags: LayerFlags

    @classmethod
    def of(cls, model) -> DraftTarget:
        """For a transformer-family model, or a hybrid one with attention layers (the MTP
        layer is an attention layer shaped like them, with a SwiGLU MLP)."""
        from heron.plugins.hybrid_ssm.model import HybridModel
        cfg = getattr(model, "cfg", None)
        if isinstance(model, TransformerModel):
            flags = LayerFlags(cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.mlp_bias)
            return cls(model.embed, model.lm_head, cfg.tie_word_embeddings, cfg.num_layers,
                       cfg.rms_norm_eps, model.shape, model.cos_sin, flags)
        if isinstance(model, HybridModel) and model.attn_shape is not None:
            a = cfg.attention
            return cls(model.embed, model.lm_head, cfg.tie_word_embeddings, cfg.num_layers,
                       cfg.rms_norm_eps, model.attn_shape, model.cos_sin,
                       LayerFlags(a.bias, a.bias, False, cfg.mlp_bias))
        raise ValueError("speculative method 'mtp' drafts for transformer-family models and "
                         "hybrids with attention layers")


@dataclass
class MtpWeights:
    embed: torch.Tensor             # [vocab, hidden]
    embed_norm: torch.Tensor        # enorm / pre_fc_norm_embedding, as a plain scale
    hidden_norm: torch.Tensor       # hnorm / pre_fc_norm_hidden
    proj: torch.Tensor              # eh_proj / fc: [hidden, 2 hidden], packed
    layer: LayerWeights
    out_norm: torch.Tensor          # shared_head.norm / norm
    head: torch.Tensor              # [V', hidden], packed
    draft_token_ids: torch.Tensor | None  # [V'] token of each head row; None: all
    #: DeepSeek-V3: the MTP input at position 0 has no embedding (as vLLM runs it), and the
    #: state chained to the next draft is the layer's output before ``out_norm``.
    #: Qwen3-Next: the embedding is kept, and the chained state is after ``out_norm``.
    deepseek: bool
    hidden_layer: int | None = None  # the target layer whose output it reads; None: final


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open
    names = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names += list(f.keys())
    return names


def load_mtp(path: Path, target: DraftTarget,
             projection_dtype: torch.dtype | None = None) -> MtpWeights:
    """The MTP module in the checkpoint at ``path`` (a directory or one ``.safetensors``
    file) for ``target``, its projections in ``projection_dtype`` (None: the target's);
    ValueError naming what is missing."""
    names = _keys(path)
    layers = sorted(int(m.group(1)) for n in names if (m := _DEEPSEEK.fullmatch(n)))
    if layers:
        prefix, deepseek = f"model.layers.{layers[0]}.", True
    elif "mtp.fc.weight" in names:
        prefix, deepseek = "mtp.", False
    else:
        raise ValueError(f"{str(path)!r} holds no MTP weights (neither DeepSeek-V3's "
                         "model.layers.N.eh_proj nor Qwen3-Next's mtp.fc)")
    device, dtype = target.embed.device, target.embed.dtype
    w = Weights(load_safetensors(path, torch.float32, keep=lambda n: n.startswith(prefix)),
                device, dtype)
    draft_ids = w.tensors.pop(prefix + "draft_token_ids", None)
    hidden_layer = w.tensors.pop(prefix + "hidden_layer", None)
    if hidden_layer is not None:
        hidden_layer = int(hidden_layer)
        if not 1 <= hidden_layer <= target.num_layers:
            raise ValueError(f"MTP weights in {str(path)!r}: hidden_layer {hidden_layer} is "
                             f"not a layer of the target's 1..{target.num_layers}")
    cfg = target.flags
    try:
        if deepseek:
            embed = w.take(prefix + "embed_tokens.weight", required=False)
            names = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
            head = w.take(prefix + "shared_head.head.weight", required=False)
            layer = load_layer(w, prefix, cfg)
        else:
            embed, head = None, None
            names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
            layer = load_layer(w, prefix + "layers.0.", cfg)
        embed_norm, hidden_norm, proj, out_norm = (w.take(prefix + n + ".weight")
                                                   for n in names)
    except KeyError as e:
        raise ValueError(f"MTP weights in {str(path)!r}: {e.args[0]}") from None
    if not deepseek:  # zero-centred norms
        embed_norm, hidden_norm, out_norm = embed_norm + 1, hidden_norm + 1, out_norm + 1
        layer.input_norm, layer.post_norm = layer.input_norm + 1, layer.post_norm + 1
        if layer.attn.q_norm is not None:
            layer.attn.q_norm, layer.attn.k_norm = layer.attn.q_norm + 1, layer.attn.k_norm + 1
    if w.tensors:
        raise ValueError(f"MTP weights in {str(path)!r}: unexpected tensors "
                         f"{sorted(w.tensors)[:4]}")
    if head is not None:
        head = pack_weight(head)
    elif draft_ids is None:
        head = target.lm_head  # packed already
    else:
        full = target.embed if target.tied else unpack_weight(target.lm_head)
        head = pack_weight(full[draft_ids.to(device)])
    if draft_ids is not None and head.shape[0] != draft_ids.shape[0]:
        raise ValueError(f"MTP weights in {str(path)!r}: {head.shape[0]} head rows for "
                         f"{draft_ids.shape[0]} draft_token_ids")
    weights = MtpWeights(
        embed=target.embed if embed is None else embed, embed_norm=embed_norm,
        hidden_norm=hidden_norm, proj=pack_weight(proj), layer=layer, out_norm=out_norm,
        head=head,
        draft_token_ids=None if draft_ids is None else draft_ids.to(device),
        deepseek=deepseek, hidden_layer=hidden_layer)
    if projection_dtype not in (None, dtype):
        _cast_projections(weights, projection_dtype)
    return weights


def _cast_projections(w: MtpWeights, dtype: torch.dtype) -> None:
    """``w``'s projection weights, in place, as ``dtype`` (new tensors: the head may be the
    target's). Norms, biases and the embedding keep theirs."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return pack_weight(unpack_weight(t).to(dtype))

    attn, layer = w.layer.attn, w.layer
    attn.qkv, attn.o = cast(attn.qkv), cast(attn.o)
    layer.gate_up, layer.down = cast(layer.gate_up), cast(layer.down)
    w.proj, w.head = cast(w.proj), cast(w.head)
