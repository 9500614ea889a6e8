"""A benchmark-only model family: Llama-shaped random weights made on the device, no files.

Registered through the ordinary plugin API (`RandomLlamaPlugin`), so the engine, scheduler,
cache and CUDA graphs are exactly the served path; only the weights are random. The model
"path" is a directory holding just a ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from heron.core import FamilySpec, LoadedModel, ModelInfo, hookimpl
from heron.plugins.transformer.config import TransformerConfig
from heron.plugins.transformer.model import TransformerModel
from heron.plugins.transformer.runner import TransformerRunner

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}


def random_tensors(cfg: TransformerConfig, device, dtype, std: float = 0.02) -> dict:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype) * std

    t = {"model.embed_tokens.weight": rand(cfg.vocab_size, h),
         "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
         "lm_head.weight": rand(cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        t.update({
            p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i)})
    return t


def load(path: str, model_config, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    cfg = TransformerConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
    model = TransformerModel(cfg, random_tensors(cfg, device, dtype), device, dtype)
    info = ModelInfo(name="random-llama", vocab_size=cfg.vocab_size,
                     max_context_len=cfg.max_position_embeddings, eos_token_ids=(),
                     dtype=dtype, device=device)
    return LoadedModel(TransformerRunner(model, info), tokenizer=None)


class RandomLlamaPlugin:
    @hookimpl
    def heron_register_families(self, register):
        register(FamilySpec(name="random-llama", loader="bench.random_model:load"))


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory
