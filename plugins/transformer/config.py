"""The decoder-only architecture facts heron needs, read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass

from heron.core.ops.rotary import rope_type

ARCHITECTURES = ("GraniteForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                 "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Phi3ForCausalLM",
                 "Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")
_OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# the same models saved without their LM head (embedding models): architecture -> with one
BARE_ARCHITECTURES = {a.removesuffix("ForCausalLM") + "Model": a for a in ARCHITECTURES}
# ... and with a score head in its place (classifiers, cross-encoders, reward models; Granite
# has no such form in transformers)
CLASSIFIER_ARCHITECTURES = {a.removesuffix("ForCausalLM") + "ForSequenceClassification": a
                            for a in ARCHITECTURES if a != "GraniteForCausalLM"}


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_lm_head: bool  # False for a bare model or a classifier
    has_score_head: bool  # a classifier's (`CLASSIFIER_ARCHITECTURES`)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    # the window of layers that attend only to their last tokens (Mistral v0.1's 4096);
    # heron attends to the whole context, the same up to this many tokens
    sliding_window: int | None = None
    # layers that attend without rotary embeddings (SmolLM3's NoPE layers, every fourth)
    nope_layers: frozenset[int] = frozenset()
    # the dims of each head that rotate, the first ones (Phi's partial_rotary_factor); 0: all
    rotary_dim: int = 0
    # Granite's constants: the embeddings and each layer's attention and MLP outputs are
    # multiplied, the logits divided; attention scores scaled by attention_multiplier
    # (None: head_dim ** -0.5)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # OLMo 2's layers norm their attention's and MLP's outputs before adding them, rather
    # than their inputs, and its q/k norms span all heads
    norms_after: bool = False
    # layers whose rope is their own, (theta, scaling): OLMo 3's windowed layers rotate
    # without the YaRN scaling its full layers have
    local_rope_layers: frozenset[int] = frozenset()
    local_rope: tuple[float, dict | None] = (10000.0, None)

    @property
    def max_context_len(self) -> int:
        """The longest context served: the positions, or the sliding window where there is
        one (past it, whole-context attention would differ from the model's)."""
        return min(self.max_position_embeddings, self.sliding_window or 1 << 62)

    @classmethod
    def from_hf(cls, cfg: dict) -> TransformerConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        bare = arch in BARE_ARCHITECTURES
        classifier = arch in CLASSIFIER_ARCHITECTURES
        arch = BARE_ARCHITECTURES.get(arch) or CLASSIFIER_ARCHITECTURES.get(arch, arch)
        if arch not in ARCHITECTURES:
            raise ValueError(f"the transformer family does not serve {arch!r}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        params = cfg.get("rope_parameters") or {}
        layer_types = cfg.get("layer_types") or ()
        local = None
        if "full_attention" in params:  # one rope per layer type (OLMo 3's)
            theta, partial, scaling = rope_settings(params["full_attention"], {})
            local = rope_settings(params.get("sliding_attention"), {})
        else:
            theta, partial, scaling = rope_settings(params, cfg)
            if arch == "Olmo3ForCausalLM":  # an older config's scaling is the full layers'
                local = (theta, partial, None)
        local_layers = frozenset(i for i, kind in enumerate(layer_types)
                                 if kind == "sliding_attention") if local else frozenset()
        positions = cfg.get("max_position_embeddings", 2048)
        if rope_type(scaling) == "yarn":
            # YaRN stretches the original context by its factor (vLLM's reading; Qwen's
            # long-context recipe adds the scaling and leaves the positions as they were)
            positions = max(positions, int(scaling["original_max_position_embeddings"]
                                           * (scaling.get("factor") or 1)))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            has_lm_head=not (bare or classifier),
            has_score_head=classifier,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in (*_OLMO, "Qwen3ForCausalLM"),
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(cfg, arch),
            nope_layers=_nope_layers(cfg) if arch == "SmolLM3ForCausalLM" else frozenset(),
            rotary_dim=int(head_dim * partial),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_multiplier=cfg.get("attention_multiplier"),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            norms_after=arch in _OLMO,
            local_rope_layers=local_layers,
            local_rope=(local[0], local[2]) if local else (theta, None),
        )


def rope_settings(params: dict | None, cfg: dict, partial: float = 1.0
                  ) -> tuple[float, float, dict | None]:
    """(theta, the rotated fraction of a head, the scaling or None) of one rope setting:
    transformers 5's ``rope_parameters`` (or one layer type's), else an older config's
    ``rope_theta``, ``partial_rotary_factor`` and ``rope_scaling``; ``partial`` where
    neither names the fraction."""
    rope = dict(params or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or partial
    scaling = rope or cfg.get("rope_scaling")
    return float(theta), partial, None if rope_type(scaling) == "default" else scaling


def _nope_layers(cfg: dict) -> frozenset[int]:
    """SmolLM3's layers without rotary: ``no_rope_layers`` (1: the layer rotates), else every
    ``no_rope_layer_interval``-th layer (transformers' and llama.cpp's rule)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        flags = [(i + 1) % every != 0 for i in range(cfg["num_hidden_layers"])]
    return frozenset(i for i, rotates in enumerate(flags) if not rotates)


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window of any layer that has one, as transformers reads the config:
    Mistral's ``sliding_window``; Qwen2's and Qwen3's where ``layer_types`` (or, in older
    configs, ``use_sliding_window`` and ``max_window_layers``) give layers one."""
    window = cfg.get("sliding_window")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM") or not window:  # every layer's
        return window or None
    if "layer_types" in cfg:
        return window if "sliding_attention" in cfg["layer_types"] else None
    windowed = cfg.get("use_sliding_window") and (
        cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"])
    return window if windowed else None
