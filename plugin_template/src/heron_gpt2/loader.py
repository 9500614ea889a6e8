"""Loads a ``GPT2LMHeadModel`` HF directory: config, safetensors weights, tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core import LoadedModel, ModelConfig, ModelInfo, Tokenizer, load_safetensors
from heron_gpt2.config import GPT2Config
from heron_gpt2.model import GPT2Model
from heron_gpt2.runner import GPT2Runner

log = logging.getLogger(__name__)


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    cfg = GPT2Config.from_hf(json.loads((source / "config.json").read_text()))
    model = GPT2Model(cfg, load_safetensors(source, torch.float32), device, dtype)
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    tokenizer = Tokenizer.from_hf_dir(source)
    info = ModelInfo.of_checkpoint(source.name, cfg.vocab_size, cfg.max_positions,
                                   cfg.eos_token_ids, tokenizer, dtype, device)
    return LoadedModel(GPT2Runner(model, info), tokenizer)
