"""Loads an ``M2M100ForConditionalGeneration`` HF directory (NLLB-200 and M2M100)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core import LoadedModel, ModelConfig, ModelInfo, Tokenizer, load_safetensors
from heron.plugins.nllb.config import M2M100Config
from heron.plugins.nllb.model import NllbModel
from heron.plugins.nllb.runner import NllbRunner

log = logging.getLogger(__name__)


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    cfg = M2M100Config.from_hf(json.loads((source / "config.json").read_text()))
    model = NllbModel(cfg, load_safetensors(source, torch.float32), device, dtype)
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    tokenizer = Tokenizer.from_hf_dir(source)
    info = ModelInfo.of_checkpoint(source.name, cfg.vocab_size, cfg.max_position_embeddings,
                                   cfg.eos_token_ids, tokenizer, dtype, device)
    return LoadedModel(NllbRunner(model, info), tokenizer)
