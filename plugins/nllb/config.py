"""The M2M100 / NLLB architecture facts heron needs, read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("M2M100ForConditionalGeneration",)
ACTIVATIONS = ("relu",)


@dataclass(frozen=True)
class M2M100Config:
    vocab_size: int
    d_model: int
    num_encoder_layers: int
    num_decoder_layers: int
    num_encoder_heads: int
    num_decoder_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    activation: str
    scale_embedding: bool
    max_position_embeddings: int
    pad_token_id: int
    decoder_start_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    layer_norm_eps: float = 1e-5  # nn.LayerNorm's default: M2M100 has no config key for it

    @property
    def embed_scale(self) -> float:
        return self.d_model ** 0.5 if self.scale_embedding else 1.0

    @property
    def encoder_head_dim(self) -> int:
        return self.d_model // self.num_encoder_heads

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.num_decoder_heads

    @property
    def position_offset(self) -> int:
        """Sinusoid row of the first token: positions start after the padding row."""
        return self.pad_token_id + 1

    @classmethod
    def from_hf(cls, cfg: dict) -> M2M100Config:
        arch = (cfg.get("architectures") or ["M2M100ForConditionalGeneration"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"the nllb family does not serve {arch!r}")
        activation = cfg.get("activation_function", "relu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"the nllb family supports activation_function {ACTIVATIONS}, "
                             f"not {activation!r}")
        d_model = cfg.get("d_model", 1024)
        enc_heads = cfg.get("encoder_attention_heads", 16)
        dec_heads = cfg.get("decoder_attention_heads", 16)
        for name, heads in (("encoder_attention_heads", enc_heads),
                            ("decoder_attention_heads", dec_heads)):
            if d_model % heads:
                raise ValueError(f"d_model {d_model} is not divisible by {name} {heads}")
        pad = cfg.get("pad_token_id", 1)
        if pad is None:
            # positions are counted from the padding row; without one there is no offset
            raise ValueError("M2M100 needs a pad_token_id (its positions start after it)")
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        start = cfg.get("decoder_start_token_id")
        if start is None:
            start = eos_ids[0] if eos_ids else 2  # M2M100 starts decoding from EOS
        # defaults are transformers' M2M100Config defaults (NLLB configs spell them all out)
        return cls(
            vocab_size=cfg.get("vocab_size", 128112),
            d_model=d_model,
            num_encoder_layers=cfg.get("encoder_layers", 12),
            num_decoder_layers=cfg.get("decoder_layers", 12),
            num_encoder_heads=enc_heads,
            num_decoder_heads=dec_heads,
            encoder_ffn_dim=cfg.get("encoder_ffn_dim", 4096),
            decoder_ffn_dim=cfg.get("decoder_ffn_dim", 4096),
            activation=activation,
            scale_embedding=bool(cfg.get("scale_embedding", True)),
            max_position_embeddings=cfg.get("max_position_embeddings", 1024),
            pad_token_id=pad,
            decoder_start_token_id=start,
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
