"""Loads a Mamba2 or hybrid Mamba2/attention model from an HF safetensors directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core.config import ModelConfig
from heron.core.family import LoadedModel, ModelInfo
from heron.core.tokenizer import Tokenizer
from heron.plugins.hybrid_ssm.config import HybridConfig
from heron.plugins.hybrid_ssm.model import HybridModel
from heron.plugins.hybrid_ssm.runner import HybridRunner
from heron.core.checkpoint import is_mtp_tensor, load_safetensors

log = logging.getLogger(__name__)


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    if source.suffix == ".gguf":
        raise ValueError("the hybrid_ssm family loads HF safetensors directories, not GGUF")
    hf_config = json.loads((source / "config.json").read_text())
    cfg = HybridConfig.from_hf(hf_config)
    tensors = load_safetensors(source, torch.float32,
                               keep=lambda name: not is_mtp_tensor(name, cfg.num_layers))
    tokenizer = Tokenizer.from_hf_dir(source)
    model = HybridModel(cfg, tensors, device, dtype)
    del tensors
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    info = ModelInfo.of_checkpoint(source.name, cfg.vocab_size, cfg.max_position_embeddings,
                                   cfg.eos_token_ids, tokenizer, dtype, device)
    info.hidden_size = cfg.hidden_size
    return LoadedModel(HybridRunner(model, info), tokenizer)
