"""Loads a decoder-only model from an HF directory or a GGUF file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from heron.core.config import ModelConfig
from heron.core.family import LoadedModel, ModelInfo
from heron.core.tokenizer import Tokenizer
from heron.plugins.transformer.config import TransformerConfig
from heron.plugins.transformer.model import TransformerModel
from heron.plugins.transformer.runner import TransformerRunner
from heron.core.checkpoint import is_mtp_tensor, load_safetensors
from heron.core.ops.linear import unpack_weight
from heron.core.ops.quantized import QuantizedWeight
from heron.core.pooling import ScoreHead

log = logging.getLogger(__name__)


def load(path: str, model_config: ModelConfig, device: torch.device,
         dtype: torch.dtype) -> LoadedModel:
    source = Path(path)
    if source.suffix == ".gguf":
        from heron.plugins.transformer.gguf_loader import load_gguf
        # quantized blocks multiply float32 rows on the CPU; elsewhere they are dequantized
        keep = (model_config.keep_quantized is not False and device.type == "cpu"
                and dtype == torch.float32)
        hf_config, tensors, tokenizer = load_gguf(
            source, keep_quantized=keep, int8_activations=model_config.keep_quantized == "int8")
        cfg = TransformerConfig.from_hf(hf_config)
    else:
        cfg = TransformerConfig.from_hf(json.loads((source / "config.json").read_text()))
        tensors = load_safetensors(source, torch.float32,
                                   keep=lambda name: not is_mtp_tensor(name, cfg.num_layers))
        if not cfg.has_lm_head and "model.embed_tokens.weight" not in tensors:
            # a bare model saved on its own names its tensors without the "model." prefix
            tensors = {f"model.{name}": t for name, t in tensors.items()}
        tokenizer = Tokenizer.from_hf_dir(source)
    model = TransformerModel(cfg, tensors, device, dtype)
    del tensors
    if model_config.classifier_from_tokens:
        model.classifier = _classifier_from_tokens(model, tokenizer,
                                                   model_config.classifier_from_tokens)
    if model.unused_tensors:
        log.warning("checkpoint tensors not used: %s", model.unused_tensors[:8])
    if cfg.max_context_len < cfg.max_position_embeddings:
        log.info("%s: layers attend through a sliding window of %d tokens, which heron does "
                 "not implement; contexts are served up to that length", source.name,
                 cfg.sliding_window)
    info = ModelInfo.of_checkpoint(source.name, cfg.vocab_size, cfg.max_context_len,
                                   cfg.eos_token_ids, tokenizer, dtype, device)
    info.hidden_size = cfg.hidden_size
    return LoadedModel(TransformerRunner(model, info), tokenizer)


def _classifier_from_tokens(model: TransformerModel, tokenizer: Tokenizer | None,
                            tokens: list[str]) -> ScoreHead:
    """A score head of the LM head's rows for ``tokens``; two, [no, yes], make one row,
    yes - no, whose sigmoid is the two-way softmax's probability of yes."""
    ids = [tokenizer.token_to_id(t) if tokenizer is not None else None for t in tokens]
    if None in ids:
        raise ValueError(f"model.classifier_from_tokens: {tokens[ids.index(None)]!r} is not a "
                         "token of the model's vocabulary")
    head = model.lm_head
    if isinstance(head, QuantizedWeight):  # those rows' blocks alone, not the whole head
        rows = QuantizedWeight(head.blocks[ids], head.qtype, head.in_features).dequantize()
    else:
        rows = unpack_weight(head)[ids].float()
    return ScoreHead((rows[1] - rows[0])[None] if len(ids) == 2 else rows)
