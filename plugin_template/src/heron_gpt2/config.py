"""The GPT-2 facts heron needs, read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass

#: transformers' names for the activations this family computes.
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    hidden_size: int
    inner_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    layer_norm_eps: float
    activation: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> GPT2Config:
        if cfg.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not served")
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation_function {activation!r} is not one of {ACTIVATIONS}")
        hidden = cfg["n_embd"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            inner_size=cfg.get("n_inner") or 4 * hidden,
            num_layers=cfg["n_layer"],
            num_heads=cfg["n_head"],
            max_positions=cfg["n_positions"],
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            activation=activation,
            scale_attn_weights=cfg.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=cfg.get("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )
