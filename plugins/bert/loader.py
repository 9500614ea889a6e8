"""Loads a BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT, DeBERTa-v2/v3, NomicBERT or
GTE HF directory: an encoder (``...Model``, what embedding models are saved as) or a
cross-encoder (``...ForSequenceClassification``); or an encoder from a llama.cpp GGUF file
(`heron.plugins.bert.gguf`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core import LoadedModel, ModelConfig, ModelInfo, Tokenizer, load_safetensors
from heron.plugins.bert.config import (DEBERTA, GTE, MODERNBERT, NOMIC, DebertaConfig,
                                       EncoderConfig, ModernBertConfig, RopeEncoderConfig)
from heron.plugins.bert.deberta import DebertaModel
from heron.plugins.bert.gguf import load_bert_gguf
from heron.plugins.bert.model import EncoderModel
from heron.plugins.bert.modernbert import ModernBertModel
from heron.plugins.bert.rope_encoder import RopeEncoderModel
from heron.plugins.bert.runner import EncoderRunner

log = logging.getLogger(__name__)

# architecture -> its config and model classes, where not BERT's (nor ModernBERT's)
_KINDS = {**dict.fromkeys(DEBERTA, (DebertaConfig, DebertaModel)),
          **dict.fromkeys((*NOMIC, *GTE), (RopeEncoderConfig, RopeEncoderModel))}


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    from_gguf = source.suffix == ".gguf"
    if from_gguf:
        config, tensors, tokenizer = load_bert_gguf(source)
    else:
        config = json.loads((source / "config.json").read_text())
        tensors = load_safetensors(source, torch.float32)
        tokenizer = Tokenizer.from_hf_dir(source)
    arch = (config.get("architectures") or [""])[0]
    if arch in MODERNBERT:
        cfg = ModernBertConfig.from_hf(config)
        model = ModernBertModel(cfg, tensors, device, dtype)
        pooling, types = cfg.classifier_pooling, 0
    else:
        config_cls, model_cls = _KINDS.get(arch, (EncoderConfig, EncoderModel))
        cfg = config_cls.from_hf(config)
        model = model_cls(cfg, tensors, device, dtype)
        # BERT's two segment types; RoBERTa's one reads as none (every token is 0)
        pooling, types = "cls", cfg.type_vocab_size if cfg.type_vocab_size > 1 else 0
    del tensors
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    info = ModelInfo.of_checkpoint(source.stem if from_gguf else source.name, cfg.vocab_size,
                                   cfg.max_context_len, (), tokenizer, dtype, device)
    info.hidden_size = cfg.hidden_size
    return LoadedModel(EncoderRunner(model, info, pooling, types), tokenizer)
