"""Loads an ``M2M100ForConditionalGeneration`` HF directory (NLLB-200 and M2M100).

`ModelInfo.extra` carries what a server needs to build translation requests:
``decoder_start_token_id``, ``source_eos_token_id`` (ends every source) and
``language_codes`` (NLLB code → token id: the tokenizer's special tokens shaped like
``eng_Latn``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core import LoadedModel, ModelConfig, ModelInfo, Tokenizer, load_safetensors
from heron.core.config import LANGUAGE_CODE
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
    info.extra.update(decoder_start_token_id=cfg.decoder_start_token_id,
                      source_eos_token_id=_source_eos(cfg, tokenizer),
                      language_codes=language_codes(tokenizer, cfg.vocab_size))
    return LoadedModel(NllbRunner(model, info), tokenizer)


def language_codes(tokenizer: Tokenizer | None, vocab_size: int) -> dict[str, int]:
    """The tokenizer's NLLB language codes (special added tokens like ``fra_Latn``, inside
    the model's vocabulary) → their ids."""
    if tokenizer is None:
        return {}
    added = tokenizer.backend.get_added_tokens_decoder()
    return {t.content: i for i, t in sorted(added.items())
            if t.special and i < vocab_size and LANGUAGE_CODE.fullmatch(t.content)}


def _source_eos(cfg: M2M100Config, tokenizer: Tokenizer | None) -> int:
    """The EOS NllbTokenizer appends to a source: its ``eos_token``, else the config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.decoder_start_token_id
