"""The encoder facts heron needs (BERT, RoBERTa, XLM-RoBERTa, DistilBERT; ModernBERT;
DeBERTa-v2/v3; NomicBERT and GTE), read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass

# architecture -> the prefix its tensors carry in a model with a head
ENCODERS = {"BertModel": "bert", "RobertaModel": "roberta", "XLMRobertaModel": "roberta",
            "DistilBertModel": "distilbert"}
CLASSIFIERS = {a.removesuffix("Model") + "ForSequenceClassification": p
               for a, p in ENCODERS.items()}
MODERNBERT = ("ModernBertModel", "ModernBertForSequenceClassification")
DEBERTA = ("DebertaV2Model", "DebertaV2ForSequenceClassification")
NOMIC = ("NomicBertModel",)
# transformers' GTE, and the hub checkpoints' own (`NewModel`, remote code)
GTE = ("GteModel", "NewModel")
ARCHITECTURES = (*ENCODERS, *CLASSIFIERS, *MODERNBERT, *DEBERTA, *NOMIC, *GTE)
# transformers' ACT2FN names heron computes (`heron.plugins.bert.model.ACTIVATION_FNS`)
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")


@dataclass(frozen=True)
class EncoderShape:
    """What every encoder of the family has."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    is_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def check_activations(cfg: dict, arch: str, *keys: str) -> None:
        """A ValueError naming the first of ``keys`` (transformers' default: gelu) whose
        activation the family does not compute."""
        for key in keys:
            if cfg.get(key, "gelu") not in ACTIVATIONS:
                raise ValueError(f"{arch}: {key} {cfg[key]!r}; the bert family computes "
                                 f"{', '.join(ACTIVATIONS)}")

    @staticmethod
    def shape_of(cfg: dict, arch: str) -> dict:
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError(f"{arch}: hidden_size {cfg['hidden_size']} is not a multiple of "
                             f"num_attention_heads {cfg['num_attention_heads']}")
        return dict(architecture=arch, vocab_size=cfg["vocab_size"],
                    hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                    num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                    is_classifier=arch.endswith("ForSequenceClassification"))


@dataclass(frozen=True)
class EncoderConfig(EncoderShape):
    prefix: str  # "bert" | "roberta": the tensors' prefix, and how positions are numbered
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int

    @property
    def position_offset(self) -> int:
        """The position row of a sequence's first token: RoBERTa numbers positions from
        ``pad_token_id + 1`` (its rows below are padding's)."""
        return self.pad_token_id + 1 if self.prefix == "roberta" else 0

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, cfg: dict) -> EncoderConfig:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"the bert family does not serve {arch!r}")
        if arch.startswith("DistilBert"):  # BERT's layers under other names, no token types
            cfg = {**cfg, "hidden_size": cfg.get("dim", 768),
                   "num_hidden_layers": cfg.get("n_layers", 6),
                   "num_attention_heads": cfg.get("n_heads", 12),
                   "intermediate_size": cfg.get("hidden_dim", 3072),
                   "hidden_act": cfg.get("activation", "gelu"), "type_vocab_size": 0}
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"{arch}: position_embedding_type {kind!r}; the bert family "
                             "computes absolute position embeddings only")
        cls.check_activations(cfg, arch, "hidden_act")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{arch} is configured as a decoder; the bert family serves "
                             "encoders")
        return cls(
            **cls.shape_of(cfg, arch),
            prefix=ENCODERS.get(arch) or CLASSIFIERS[arch],
            hidden_act=cfg.get("hidden_act", "gelu"),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            pad_token_id=cfg.get("pad_token_id") or 0,
        )


@dataclass(frozen=True)
class ModernBertConfig(EncoderShape):
    """ModernBERT: pre-norm layers, rotary positions, a GeGLU FFN, and layers that attend
    globally (every ``global_attn_every_n_layers``-th, from the first) or within a sliding
    window of ``local_attention / 2`` positions either way, each kind with its rope theta."""

    hidden_act: str
    classifier_act: str
    norm_eps: float
    max_position_embeddings: int
    window: int  # a local layer's reach either way
    local_layers: tuple[bool, ...]
    global_rope_theta: float
    local_rope_theta: float
    classifier_pooling: str  # "cls" | "mean"

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict) -> ModernBertConfig:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in MODERNBERT:
            raise ValueError(f"{arch!r} is not a ModernBERT architecture")
        cls.check_activations(cfg, arch, "hidden_activation", "classifier_activation")
        num_layers = cfg["num_hidden_layers"]
        # transformers 5 saves `layer_types` and `rope_parameters`; the checkpoints on the hub
        # `global_attn_every_n_layers` and the two thetas
        every = cfg.get("global_attn_every_n_layers", 3)
        types = cfg.get("layer_types") or ["full_attention" if i % every == 0
                                           else "sliding_attention" for i in range(num_layers)]
        rope = cfg.get("rope_parameters") or {}
        scaled = [p.get("rope_type") for p in (*rope.values(), cfg.get("rope_scaling") or {})
                  if p and p.get("rope_type", "default") != "default"]
        if scaled:
            raise ValueError(f"{arch}: rope_type {scaled[0]!r}; the bert family computes "
                             "ModernBERT's default rotary embedding only")
        global_theta = float((rope.get("full_attention") or {}).get("rope_theta")
                             or cfg.get("global_rope_theta") or 160000.0)
        # an unset local theta is the global one (as transformers 4 read these configs)
        local_theta = float((rope.get("sliding_attention") or {}).get("rope_theta")
                            or cfg.get("local_rope_theta", 10000.0) or global_theta)
        pooling = cfg.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"{arch}: classifier_pooling {pooling!r}; the bert family pools "
                             "with cls or mean")
        return cls(
            **cls.shape_of(cfg, arch),
            hidden_act=cfg.get("hidden_activation", "gelu"),
            classifier_act=cfg.get("classifier_activation", "gelu"),
            norm_eps=cfg.get("norm_eps", 1e-5),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            window=cfg.get("local_attention", 128) // 2,
            local_layers=tuple(t == "sliding_attention" for t in types),
            global_rope_theta=global_theta,
            local_rope_theta=local_theta,
            classifier_pooling=pooling,
        )


@dataclass(frozen=True)
class DebertaConfig(EncoderShape):
    """DeBERTa-v2 and -v3: BERT's post-norm layers with disentangled attention, where each
    score adds the query's content against the key's relative position (``c2p``) and the
    key's content against the query's (``p2c``), relative positions bucketed on a log scale
    past ``position_buckets / 2``; absolute positions (``position_biased_input``) and token
    types only where configured (v3 has neither)."""

    hidden_act: str
    pooler_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    embedding_size: int
    absolute_positions: bool  # position_biased_input
    relative_attention: bool
    c2p: bool
    p2c: bool
    position_buckets: int  # 0: relative positions unbucketed
    max_relative_positions: int
    norm_rel_embeddings: bool
    share_att_key: bool  # position keys and queries through the content projections

    @property
    def span(self) -> int:
        """Relative positions reach this far either way (the table has twice as many rows)."""
        return self.position_buckets or self.max_relative_positions

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict) -> DebertaConfig:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in DEBERTA:
            raise ValueError(f"{arch!r} is not a DeBERTa-v2 architecture")
        cls.check_activations(cfg, arch, "hidden_act", "pooler_hidden_act")
        if cfg.get("conv_kernel_size", 0) > 0:
            raise ValueError(f"{arch}: conv_kernel_size {cfg['conv_kernel_size']}; the bert "
                             "family computes DeBERTa without the convolution layer")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if cfg.get("attention_head_size", hidden // heads) * heads != hidden:
            raise ValueError(f"{arch}: attention_head_size {cfg['attention_head_size']} x "
                             f"{heads} heads is not hidden_size {hidden}")
        if cfg.get("pooler_hidden_size", hidden) != hidden:
            raise ValueError(f"{arch}: pooler_hidden_size {cfg['pooler_hidden_size']} is not "
                             f"hidden_size {hidden}")
        kinds = cfg.get("pos_att_type") or []
        if isinstance(kinds, str):  # older configs: "p2c|c2p"
            kinds = [k.strip() for k in kinds.lower().split("|")]
        max_positions = cfg.get("max_position_embeddings", 512)
        max_relative = cfg.get("max_relative_positions", -1)
        return cls(
            **cls.shape_of(cfg, arch),
            hidden_act=cfg.get("hidden_act", "gelu"),
            pooler_act=cfg.get("pooler_hidden_act", "gelu"),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-7),
            max_position_embeddings=max_positions,
            type_vocab_size=cfg.get("type_vocab_size", 0),
            embedding_size=cfg.get("embedding_size") or hidden,
            absolute_positions=cfg.get("position_biased_input", True),
            relative_attention=cfg.get("relative_attention", False),
            c2p="c2p" in kinds,
            p2c="p2c" in kinds,
            position_buckets=max(cfg.get("position_buckets", -1), 0),
            max_relative_positions=max_relative if max_relative >= 1 else max_positions,
            norm_rel_embeddings="layer_norm" in [
                k.strip() for k in cfg.get("norm_rel_ebd", "none").lower().split("|")],
            share_att_key=cfg.get("share_att_key", False),
        )


# nomic-embed's own config.json (its remote code's, GPT-2 style) -> transformers' names
_NOMIC_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
               "n_head": "num_attention_heads", "n_inner": "intermediate_size",
               "layer_norm_epsilon": "layer_norm_eps"}
# transformers' defaults where a config leaves a field out: NomicBertConfig's (the shape of
# nomic-embed-text-v1.5), GteConfig's (gte-multilingual-base's)
_NOMIC_DEFAULTS = dict(vocab_size=30528, hidden_size=768, num_hidden_layers=12,
                       num_attention_heads=12, intermediate_size=3072, hidden_act="silu",
                       type_vocab_size=2, max_position_embeddings=2048, rope_theta=1000.0)
_GTE_DEFAULTS = dict(vocab_size=250048, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072, hidden_act="gelu",
                     type_vocab_size=1, max_position_embeddings=8192, rope_theta=160000.0)
# settings of the checkpoints' own code heron computes only as shown (key: accepted value)
_OWN_SETTINGS = {"moe_every_n_layers": 0, "prenorm": False, "rotary_emb_fraction": 1.0,
                 "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
                 "use_rms_norm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
                 "mlp_fc2_bias": False, "layer_norm_type": "layer_norm",
                 "logn_attention_scale": False, "rope_scaling": None}


@dataclass(frozen=True)
class RopeEncoderConfig(EncoderShape):
    """NomicBERT (nomic-embed-text v1 and v1.5) and GTE: post-norm layers, token types
    where configured, rotary positions (rotate-half) in place of position embeddings and a
    gated FFN. Read from transformers' configs or from the checkpoints' own (nomic's
    ``n_embd``, ``rotary_emb_base``, ...; GTE's ``NewModel``); nomic's context is its
    ``max_trained_positions`` (the positions it was trained on, as vLLM and llama.cpp serve
    it)."""

    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    rope_theta: float

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict) -> RopeEncoderConfig:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in (*NOMIC, *GTE):
            raise ValueError(f"{arch!r} is not a NomicBERT or GTE architecture")
        nomic_own = "n_embd" in cfg
        cfg = {**(_NOMIC_DEFAULTS if arch in NOMIC else _GTE_DEFAULTS), **cfg,
               **{new: cfg[old] for old, new in _NOMIC_KEYS.items() if old in cfg}}
        refused = [(key, cfg[key]) for key, value in _OWN_SETTINGS.items()
                   if key in cfg and cfg[key] != value and not (value == 0 and not cfg[key])]
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or rope.get(
                "partial_rotary_factor", 1) != 1:
            refused.append(("rope_parameters", rope))
        heads = cfg["num_attention_heads"]
        if cfg.get("head_dim", cfg["hidden_size"] // heads) * heads != cfg["hidden_size"]:
            refused.append(("head_dim", cfg["head_dim"]))
        if cfg.get("position_embedding_type", "rope") != "rope":
            refused.append(("position_embedding_type", cfg["position_embedding_type"]))
        act = cfg.get("activation_function") or cfg["hidden_act"]
        act = {"swiglu": "silu", "geglu": "gelu"}.get(act, act)
        if act not in ACTIVATIONS:
            refused.append(("activation_function" if nomic_own else "hidden_act", act))
        if refused:
            key, value = refused[0]
            raise ValueError(f"{arch}: {key} {value!r}; the bert family computes NomicBERT "
                             "and GTE with full rotary embeddings without scaling, post-norm "
                             "LayerNorm layers and a gated FFN (nomic-embed-text v1 and "
                             "v1.5, not v2's experts)")
        return cls(
            **cls.shape_of(cfg, arch),
            hidden_act=act,
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=(cfg.get("max_trained_positions", 2048) if nomic_own
                                     else cfg["max_position_embeddings"]),
            type_vocab_size=cfg["type_vocab_size"],
            rope_theta=float(rope.get("rope_theta") or cfg.get("rotary_emb_base")
                             or cfg["rope_theta"]),
        )
