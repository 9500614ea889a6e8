"""Reads a BERT-style encoder from a llama.cpp GGUF file (architecture ``bert``, as its
converter writes bge, e5, all-MiniLM, mxbai-embed and snowflake-arctic-embed, and
XLM-RoBERTa's bge-m3 and multilingual-e5): an HF-style config, the tensors under their
transformers names (dequantized to float32) and the tokenizer (BERT's WordPiece or
XLM-RoBERTa's Unigram vocabulary: `Tokenizer.from_gguf`).

llama.cpp's converter writes XLM-RoBERTa checkpoints as ``bert`` too, with their position
rows already shifted to start at 0, so every file reads as a `BertModel`. Its sequence
classifiers (``pooling_type`` rank, ``cls.*`` tensors) are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from heron.core import Tokenizer
from heron.core.model_loader import read_gguf
from heron.plugins.transformer.gguf_loader import dequantize_tensor

_GLOBAL_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key",
    "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} is not part of a BERT encoder heron reads"
                         + (" (a reranker's head: GGUF rerankers are not served; use the "
                            "HF checkpoint)" if name.startswith("cls") else ""))
    return f"encoder.layer.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def load_bert_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                              Tokenizer]:
    """(config, tensors, tokenizer) of the GGUF file at ``path``: ``config`` reads like a
    `BertModel`'s ``config.json``, ``tensors`` are float32 under a bare `BertModel`'s
    names. ValueError for another architecture, a reranker or another kind of
    vocabulary."""
    reader = read_gguf(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if (arch := field("general.architecture")) != "bert":
        raise ValueError(f"GGUF architecture {arch!r} is not a BERT encoder")
    if (kind := field("tokenizer.ggml.model")) not in ("bert", "t5"):
        raise ValueError(f"{Path(path).name}: tokenizer.ggml.model {kind!r}; the bert family "
                         "reads WordPiece ('bert', BERT's) and Unigram ('t5', XLM-RoBERTa's) "
                         "vocabularies from GGUF files")
    tensors = {_hf_name(t.name): torch.from_numpy(dequantize_tensor(t)) for t in reader.tensors}
    words = tensors["embeddings.word_embeddings.weight"]
    types = tensors.get("embeddings.token_type_embeddings.weight")
    config = {
        "architectures": ["BertModel"],
        "vocab_size": words.shape[0],
        "hidden_size": field("bert.embedding_length"),
        "intermediate_size": field("bert.feed_forward_length"),
        "num_hidden_layers": field("bert.block_count"),
        "num_attention_heads": field("bert.attention.head_count"),
        "layer_norm_eps": float(field("bert.attention.layer_norm_epsilon", 1e-12)),
        "max_position_embeddings": tensors["embeddings.position_embeddings.weight"].shape[0],
        "type_vocab_size": 0 if types is None else types.shape[0],
        "pad_token_id": field("tokenizer.ggml.padding_token_id", 0),
    }
    if types is None:  # a file without the type rows: every token is type 0 (none added)
        tensors["embeddings.token_type_embeddings.weight"] = torch.zeros(1, words.shape[1])
        config["type_vocab_size"] = 1
    return config, tensors, Tokenizer.from_gguf(reader)
