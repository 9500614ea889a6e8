"""The facts heron needs about a Mamba2 / hybrid model, read from an HF ``config.json`` dict.

Each architecture names the same things differently; `HybridConfig.from_hf` maps them onto
one description: per layer a mixer (``mamba``, ``attention``, ``parallel`` = both summed, as
Falcon-H1 does, or None) and a feed-forward (``mlp``, ``moe`` or None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from heron.plugins.transformer.config import rope_settings

ARCHITECTURES = ("Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM",
                 "NemotronHForCausalLM", "FalconH1ForCausalLM")

_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


@dataclass(frozen=True)
class MambaConfig:
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    dt_limit: tuple[float, float]
    norm_eps: float
    has_norm: bool = True          # Falcon-H1 may gate without a norm
    norm_before_gate: bool = False

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.num_groups * self.state_size

    @property
    def clamps_dt(self) -> bool:
        return self.dt_limit[0] > 0 or self.dt_limit[1] < math.inf


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    bias: bool
    rope_dim: int                  # rotated dims per head; 0: no position embedding
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    router: str                    # "softmax" (Granite) or "sigmoid_groups" (NemotronH)
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None


@dataclass(frozen=True)
class HybridConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    mixers: tuple[str | None, ...]  # per layer: "mamba", "attention", "parallel" or None
    ffns: tuple[str | None, ...]    # per layer: "mlp", "moe" or None
    mamba: MambaConfig
    attention: AttentionConfig | None
    intermediate_size: int
    mlp_bias: bool
    mlp_gated: bool                 # SwiGLU (gate, up, down) or relu² (up, down)
    moe: MoeConfig | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    logits_divisor: float = 1.0
    multipliers: dict[str, float] = field(default_factory=dict)  # folded into weights at load

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.mixers) if m in ("mamba", "parallel")]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.mixers) if m in ("attention", "parallel")]

    @classmethod
    def from_hf(cls, cfg: dict) -> HybridConfig:
        arch = (cfg.get("architectures") or [None])[0]
        parse = _PARSERS.get(arch)
        if parse is None:
            raise ValueError(f"the hybrid_ssm family does not serve {arch!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        common = dict(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids)
        return cls(**common, **parse(cfg))


def _float(v) -> float:
    # transformers writes inf as {"__float__": "Infinity"}; plain json may hold Infinity
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def _dt_limit(cfg: dict, key: str = "time_step_limit") -> tuple[float, float]:
    lo, hi = cfg.get(key) or (0.0, math.inf)
    return _float(lo), _float(hi)


def _rope(cfg: dict, head_dim: int, partial: float = 1.0) -> dict:
    theta, partial, scaling = rope_settings(cfg.get("rope_parameters"), cfg, partial)
    return dict(rope_dim=int(head_dim * partial), rope_theta=theta, rope_scaling=scaling)


def _attention(cfg: dict, *, rope: bool, partial: float = 1.0, scale: float | None = None,
               head_dim: int | None = None) -> AttentionConfig:
    num_heads = cfg["num_attention_heads"]
    head_dim = head_dim or cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope_args = _rope(cfg, head_dim, partial) if rope else dict(rope_dim=0)
    return AttentionConfig(
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim, scale=scale if scale is not None else head_dim ** -0.5,
        bias=bool(cfg.get("attention_bias", False)), **rope_args)


def _check_act(cfg: dict, key: str, expected: str) -> None:
    if cfg.get(key, expected) != expected:
        raise ValueError(f"{key}={cfg[key]!r} is not supported (only {expected!r})")


def _ibm_mamba(cfg: dict, num_heads_key: str = "mamba_n_heads") -> dict:
    """The ``mamba_*`` keys Bamba, GraniteMoeHybrid and Falcon-H1 share."""
    hidden, num_heads = cfg["hidden_size"], cfg[num_heads_key]
    d_inner = cfg.get("mamba_d_ssm") or cfg.get("mamba_expand", 2) * hidden
    head_dim = cfg.get("mamba_d_head")
    head_dim = d_inner // num_heads if head_dim in (None, "auto") else head_dim
    return dict(num_heads=num_heads, head_dim=head_dim, state_size=cfg.get("mamba_d_state", 256),
                num_groups=cfg.get("mamba_n_groups", 1), conv_kernel=cfg.get("mamba_d_conv", 4),
                chunk_size=cfg.get("mamba_chunk_size", 256),
                conv_bias=bool(cfg.get("mamba_conv_bias", True)),
                in_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
                out_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
                dt_limit=_dt_limit(cfg), norm_eps=cfg.get("rms_norm_eps", 1e-6))


def _mamba2(cfg: dict) -> dict:
    _check_act(cfg, "hidden_act", "silu")
    num_layers = cfg["num_hidden_layers"]
    use_bias = bool(cfg.get("use_bias", False))
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    mamba = MambaConfig(
        num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], state_size=cfg["state_size"],
        num_groups=cfg.get("n_groups", 8), conv_kernel=cfg.get("conv_kernel", 4),
        chunk_size=cfg.get("chunk_size", 256), conv_bias=bool(cfg.get("use_conv_bias", True)),
        in_proj_bias=use_bias, out_proj_bias=use_bias, dt_limit=_dt_limit(cfg), norm_eps=eps)
    return dict(rms_norm_eps=eps, mixers=("mamba",) * num_layers, ffns=(None,) * num_layers,
                mamba=mamba, attention=None, intermediate_size=0, mlp_bias=False, mlp_gated=True,
                moe=None, max_position_embeddings=cfg.get("max_position_embeddings", 8192))


def _bamba(cfg: dict) -> dict:
    _check_act(cfg, "hidden_act", "silu")
    attn = set(cfg.get("attn_layer_indices") or ())
    mixers = tuple("attention" if i in attn else "mamba" for i in range(cfg["num_hidden_layers"]))
    return dict(rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), mixers=mixers,
                ffns=("mlp",) * len(mixers), mamba=MambaConfig(**_ibm_mamba(cfg)),
                # Bamba rotates half of each head (hard-coded in transformers)
                attention=_attention(cfg, rope=True, partial=0.5),
                intermediate_size=cfg["intermediate_size"], mlp_bias=bool(cfg.get("mlp_bias")),
                mlp_gated=True, moe=None,
                max_position_embeddings=cfg.get("max_position_embeddings", 262144))


def _granite(cfg: dict) -> dict:
    _check_act(cfg, "hidden_act", "silu")
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in
             (cfg.get("layer_types") or cfg.get("layers_block_type")
              or ["linear_attention"] * cfg["num_hidden_layers"])]
    mixers = tuple("mamba" if t == "linear_attention" else "attention" for t in types)
    num_experts = cfg.get("num_local_experts", 0) or 0
    moe = MoeConfig(num_experts=num_experts, top_k=cfg.get("num_experts_per_tok", 2),
                    intermediate_size=cfg["intermediate_size"],
                    shared_intermediate_size=cfg.get("shared_intermediate_size", 1024),
                    router="softmax")
    return dict(rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), mixers=mixers,
                ffns=("moe",) * len(mixers), mamba=MambaConfig(**_ibm_mamba(cfg)),
                attention=_attention(cfg, rope=cfg.get("position_embedding_type") == "rope",
                                     scale=cfg.get("attention_multiplier", 1.0)),
                intermediate_size=cfg["intermediate_size"], mlp_bias=False, mlp_gated=True,
                moe=moe, max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
                logits_divisor=cfg.get("logits_scaling", 1.0),
                multipliers={"residual": cfg.get("residual_multiplier", 1.0)})


def _nemotron_h(cfg: dict) -> dict:
    _check_act(cfg, "mamba_hidden_act", "silu")
    _check_act(cfg, "mlp_hidden_act", "relu2")

    def get(key, alias, default):
        return cfg.get(alias, cfg.get(key, default))

    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None:
        types = [_NEMOTRON_PATTERN[c] for c in cfg["hybrid_override_pattern"]]
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
    mixers = tuple({"linear_attention": "mamba", "full_attention": "attention"}.get(t)
                   for t in types)
    ffns = tuple(t if t in ("mlp", "moe") else None for t in types)
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    use_bias = bool(cfg.get("use_bias", False))
    mamba = MambaConfig(
        num_heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"],
        state_size=cfg["ssm_state_size"], num_groups=get("n_groups", "mamba_n_groups", 8),
        conv_kernel=get("conv_kernel", "mamba_d_conv", 4),
        chunk_size=get("chunk_size", "mamba_chunk_size", 128),
        conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
        in_proj_bias=use_bias, out_proj_bias=use_bias,
        # transformers' NemotronH mixer ignores time_step_limit: (time_step_min, inf)
        dt_limit=(float(get("time_step_min", "mamba_dt_min", 0.001)), math.inf), norm_eps=eps)
    moe = None
    if "moe" in ffns:
        moe = MoeConfig(
            num_experts=cfg["n_routed_experts"], top_k=cfg.get("num_experts_per_tok", 2),
            intermediate_size=cfg["moe_intermediate_size"],
            shared_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
            router="sigmoid_groups", num_groups=cfg.get("n_group", 1),
            topk_groups=cfg.get("topk_group", 1), norm_topk_prob=cfg.get("norm_topk_prob", True),
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            latent_size=cfg.get("moe_latent_size"))
    return dict(rms_norm_eps=eps, mixers=mixers, ffns=ffns, mamba=mamba,
                # NemotronH attention has no biases and no position embedding
                attention=replace(_attention(cfg, rope=False, head_dim=cfg.get("head_dim", 128)),
                                  bias=False),
                intermediate_size=cfg.get("intermediate_size", 21504),
                mlp_bias=bool(cfg.get("mlp_bias", False)), mlp_gated=False, moe=moe,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096))


def _falcon_h1(cfg: dict) -> dict:
    _check_act(cfg, "hidden_act", "silu")
    num_layers = cfg["num_hidden_layers"]
    mamba = MambaConfig(**{**_ibm_mamba(cfg), "out_proj_bias": bool(cfg.get("projectors_bias"))},
                        has_norm=bool(cfg.get("mamba_rms_norm", False)),
                        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)))
    gate_mult, down_mult = cfg.get("mlp_multipliers") or (1.0, 1.0)
    return dict(rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), mixers=("parallel",) * num_layers,
                ffns=("mlp",) * num_layers, mamba=mamba, attention=_attention(cfg, rope=True),
                intermediate_size=cfg["intermediate_size"], mlp_bias=bool(cfg.get("mlp_bias")),
                mlp_gated=True, moe=None,
                max_position_embeddings=cfg.get("max_position_embeddings", 8192),
                embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
                logits_multiplier=cfg.get("lm_head_multiplier", 1.0),
                multipliers={
                    "ssm_in": cfg.get("ssm_in_multiplier", 1.0),
                    "ssm_out": cfg.get("ssm_out_multiplier", 1.0),
                    "attention_in": cfg.get("attention_in_multiplier", 1.0),
                    "attention_out": cfg.get("attention_out_multiplier", 1.0),
                    "key": cfg.get("key_multiplier", 1.0),
                    "mlp_gate": gate_mult, "mlp_down": down_mult,
                    **{f"ssm_{part}": m for part, m in zip(
                        ("z", "x", "B", "C", "dt"), cfg.get("ssm_multipliers") or (1.0,) * 5)},
                })


_PARSERS = {"Mamba2ForCausalLM": _mamba2, "BambaForCausalLM": _bamba,
            "GraniteMoeHybridForCausalLM": _granite, "NemotronHForCausalLM": _nemotron_h,
            "FalconH1ForCausalLM": _falcon_h1}
