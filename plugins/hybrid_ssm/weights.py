"""Builds each layer's plain-tensor weights from a checkpoint's HF names.

Constant multipliers of the architectures (Granite's residual multiplier, Falcon-H1's µP
multipliers) are folded into the projections here, in float32, so that the forward pass
has none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.core.ops import pack_weight
from heron.plugins.hybrid_ssm.config import HybridConfig
from heron.plugins.hybrid_ssm.ffn import MlpWeights, MoeWeights
from heron.plugins.hybrid_ssm.mixer import MambaWeights
from heron.plugins.transformer.model import AttentionWeights, Weights


@dataclass
class HybridLayer:
    norm: torch.Tensor | None        # before the mixer (None: the layer has no mixer)
    mamba: MambaWeights | None
    attn: AttentionWeights | None
    ffn_norm: torch.Tensor | None    # before the feed-forward (None: no feed-forward)
    ffn: MlpWeights | MoeWeights | None


class ScaledWeights(Weights):
    """`Weights` that can scale a tensor in float32 (by a scalar, or per output row) before
    casting it, and keep some tensors in float32."""

    def take(self, name: str, required: bool = True, scale=None,
             dtype: torch.dtype | None = None) -> torch.Tensor | None:
        t = self.tensors.pop(name, None)
        if t is None:
            if required:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return None
        if scale is not None:
            scale = torch.as_tensor(scale, dtype=torch.float32)
            t = t.float() * (scale.view(-1, *[1] * (t.dim() - 1)) if scale.dim() else scale)
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def has(self, name: str) -> bool:
        return name in self.tensors


def _mamba(w: ScaledWeights, cfg: HybridConfig, p: str) -> MambaWeights:
    m, mult = cfg.mamba, cfg.multipliers
    out_scale = mult.get("ssm_out", 1.0) * mult.get("residual", 1.0)
    # Falcon-H1: the input is scaled (ssm_in), then each part of the projection (µP vector)
    gn = m.num_groups * m.state_size
    parts = [("ssm_z", m.d_inner), ("ssm_x", m.d_inner), ("ssm_B", gn), ("ssm_C", gn),
             ("ssm_dt", m.num_heads)]
    row_scale = torch.cat([torch.full((n, ), float(mult.get(k, 1.0))) for k, n in parts])
    f32 = torch.float32
    return MambaWeights(
        in_proj=pack_weight(w.take(p + "in_proj.weight", scale=row_scale * mult.get("ssm_in", 1.0))),
        in_proj_bias=(w.take(p + "in_proj.bias", scale=row_scale) if m.in_proj_bias else None),
        conv_weight=w.take(p + "conv1d.weight").reshape(m.conv_dim, m.conv_kernel).contiguous(),
        conv_bias=w.take(p + "conv1d.bias") if m.conv_bias else None,
        dt_bias=w.take(p + "dt_bias", dtype=f32),
        A=-torch.exp(w.take(p + "A_log", dtype=f32)),
        D=w.take(p + "D", dtype=f32),
        norm=w.take(p + "norm.weight") if m.has_norm else None,
        out_proj=pack_weight(w.take(p + "out_proj.weight", scale=out_scale)),
        out_proj_bias=w.take(p + "out_proj.bias", scale=out_scale) if m.out_proj_bias else None)


def _attention(w: ScaledWeights, cfg: HybridConfig, p: str) -> AttentionWeights:
    a, mult = cfg.attention, cfg.multipliers
    key, attn_in = mult.get("key", 1.0), mult.get("attention_in", 1.0)
    out = mult.get("attention_out", 1.0) * mult.get("residual", 1.0)
    names = [p + f"{n}_proj" for n in "qkv"]
    return AttentionWeights(
        qkv=pack_weight(torch.cat([w.take(names[0] + ".weight", scale=attn_in),
                                   w.take(names[1] + ".weight", scale=attn_in * key),
                                   w.take(names[2] + ".weight", scale=attn_in)])),
        qkv_bias=(torch.cat([w.take(names[0] + ".bias"), w.take(names[1] + ".bias", scale=key),
                             w.take(names[2] + ".bias")]) if a.bias else None),
        o=pack_weight(w.take(p + "o_proj.weight", scale=out)),
        o_bias=w.take(p + "o_proj.bias", scale=out) if a.bias else None)


def _gated_mlp(w: ScaledWeights, cfg: HybridConfig, p: str) -> MlpWeights:
    mult, bias = cfg.multipliers, cfg.mlp_bias
    gate, down = mult.get("mlp_gate", 1.0), mult.get("mlp_down", 1.0)
    return MlpWeights(
        up=pack_weight(torch.cat([w.take(p + "gate_proj.weight", scale=gate),
                                  w.take(p + "up_proj.weight")])),
        down=pack_weight(w.take(p + "down_proj.weight", scale=down)),
        up_bias=(torch.cat([w.take(p + "gate_proj.bias", scale=gate), w.take(p + "up_proj.bias")])
                 if bias else None),
        down_bias=w.take(p + "down_proj.bias", scale=down) if bias else None)


def _relu2_mlp(w: ScaledWeights, cfg: HybridConfig, p: str) -> MlpWeights:
    bias = cfg.mlp_bias
    return MlpWeights(up=pack_weight(w.take(p + "up_proj.weight")),
                      down=pack_weight(w.take(p + "down_proj.weight")),
                      up_bias=w.take(p + "up_proj.bias") if bias else None,
                      down_bias=w.take(p + "down_proj.bias") if bias else None, is_gated=False)


def _granite_moe(w: ScaledWeights, cfg: HybridConfig, p: str) -> MoeWeights:
    res = cfg.multipliers.get("residual", 1.0)
    shared = MlpWeights(up=pack_weight(w.take(p + "shared_mlp.input_linear.weight")),
                        down=pack_weight(w.take(p + "shared_mlp.output_linear.weight", scale=res)))
    if cfg.moe.num_experts == 0:
        return MoeWeights(router=None, experts_up=None, experts_down=None, shared=shared)
    e = p + "block_sparse_moe."
    return MoeWeights(router=w.take(e + "router.layer.weight"),
                      experts_up=w.take(e + "input_linear.weight"),
                      experts_down=w.take(e + "output_linear.weight", scale=res), shared=shared)


def _nemotron_moe(w: ScaledWeights, cfg: HybridConfig, p: str) -> MoeWeights:
    moe, bias, f32 = cfg.moe, cfg.mlp_bias, torch.float32

    def experts(kind: str) -> torch.Tensor:
        if w.has(p + f"experts.{kind}"):  # stacked [E, out, in]
            return w.take(p + f"experts.{kind}")
        return torch.stack([w.take(p + f"experts.{e}.{kind}.weight")
                            for e in range(moe.num_experts)])

    latent = moe.latent_size is not None
    return MoeWeights(
        router=w.take(p + "gate.weight", dtype=f32),
        score_bias=w.take(p + "gate.e_score_correction_bias", dtype=f32),
        experts_up=experts("up_proj"), experts_down=experts("down_proj"),
        shared=_relu2_mlp(w, cfg, p + "shared_experts."),
        latent_in=w.take(p + "fc1_latent_proj.weight") if latent else None,
        latent_in_bias=w.take(p + "fc1_latent_proj.bias") if latent and bias else None,
        latent_out=w.take(p + "fc2_latent_proj.weight") if latent else None,
        latent_out_bias=w.take(p + "fc2_latent_proj.bias") if latent and bias else None,
        is_gated=False)


def _layer_ibm(w: ScaledWeights, cfg: HybridConfig, i: int) -> HybridLayer:
    """Bamba, GraniteMoeHybrid, Falcon-H1: a mixer block, then a feed-forward block."""
    p = f"model.layers.{i}."
    mixer = cfg.mixers[i]
    is_granite = cfg.architecture == "GraniteMoeHybridForCausalLM"
    ffn_norm = "post_attention_layernorm" if is_granite else "pre_ff_layernorm"
    return HybridLayer(
        norm=w.take(p + "input_layernorm.weight"),
        mamba=_mamba(w, cfg, p + "mamba.") if mixer in ("mamba", "parallel") else None,
        attn=_attention(w, cfg, p + "self_attn.") if mixer in ("attention", "parallel") else None,
        ffn_norm=w.take(p + ffn_norm + ".weight"),
        ffn=_granite_moe(w, cfg, p) if is_granite else _gated_mlp(w, cfg, p + "feed_forward."))


def _layer_backbone(w: ScaledWeights, cfg: HybridConfig, i: int) -> HybridLayer:
    """Mamba2 and NemotronH: one norm and one mixer or feed-forward per block."""
    p = f"backbone.layers.{i}."
    norm = w.take(p + "norm.weight")
    mixer, ffn, m = cfg.mixers[i], cfg.ffns[i], p + "mixer."
    if mixer is not None:
        return HybridLayer(norm=norm, ffn_norm=None, ffn=None,
                           mamba=_mamba(w, cfg, m) if mixer == "mamba" else None,
                           attn=_attention(w, cfg, m) if mixer == "attention" else None)
    return HybridLayer(norm=None, mamba=None, attn=None, ffn_norm=norm,
                       ffn=_relu2_mlp(w, cfg, m) if ffn == "mlp" else _nemotron_moe(w, cfg, m))


def load_layers(w: ScaledWeights, cfg: HybridConfig) -> tuple[torch.Tensor, list[HybridLayer],
                                                             torch.Tensor, torch.Tensor]:
    """``(embed, layers, final_norm, lm_head)``; what is left in ``w`` was not used."""
    if cfg.architecture in ("Mamba2ForCausalLM", "NemotronHForCausalLM"):
        embed_name = ("backbone.embedding.weight" if w.has("backbone.embedding.weight")
                      else "backbone.embeddings.weight")  # older Mamba2 checkpoints
        embed = w.take(embed_name)
        layers = [_layer_backbone(w, cfg, i) for i in range(cfg.num_layers)]
        final_norm = w.take("backbone.norm_f.weight")
    else:
        embed = w.take("model.embed_tokens.weight")
        layers = [_layer_ibm(w, cfg, i) for i in range(cfg.num_layers)]
        final = "model.norm" if cfg.architecture == "GraniteMoeHybridForCausalLM" else \
            "model.final_layernorm"
        final_norm = w.take(final + ".weight")
    lm_head = w.take("lm_head.weight", required=not cfg.tie_word_embeddings)
    return embed, layers, final_norm, pack_weight(lm_head if lm_head is not None else embed)
