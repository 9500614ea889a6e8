"""Loads a BERT, RoBERTa or XLM-RoBERTa HF directory: an encoder (``...Model``, what
embedding models are saved as) or a cross-encoder (``...ForSequenceClassification``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core import LoadedModel, ModelConfig, ModelInfo, Tokenizer, load_safetensors
from heron.plugins.bert.config import EncoderConfig
from heron.plugins.bert.model import EncoderModel
from heron.plugins.bert.runner import EncoderRunner

log = logging.getLogger(__name__)


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    cfg = EncoderConfig.from_hf(json.loads((source / "config.json").read_text()))
    model = EncoderModel(cfg, load_safetensors(source, torch.float32), device, dtype)
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    tokenizer = Tokenizer.from_hf_dir(source)
    info = ModelInfo.of_checkpoint(source.name, cfg.vocab_size, cfg.max_context_len, (),
                                   tokenizer, dtype, device)
    info.hidden_size = cfg.hidden_size
    return LoadedModel(EncoderRunner(model, info, second_text_marker(tokenizer)), tokenizer)


def second_text_marker(tokenizer: Tokenizer | None) -> int | None:
    """The token after which the tokenizer's pair template types tokens 1 (BERT's
    ``[SEP]``): the one before the first token of type 1 in a pair's encoding. None when
    its template gives every token type 0 (RoBERTa's)."""
    if tokenizer is None:
        return None
    pair = tokenizer.backend.encode("a", "b")
    if 1 not in pair.type_ids:
        return None
    return pair.ids[pair.type_ids.index(1) - 1]
