"""Reads a BERT-style encoder from a llama.cpp GGUF file (architecture ``bert``, as its
converter writes bge, e5, all-MiniLM, mxbai-embed and snowflake-arctic-embed, and
XLM-RoBERTa's bge-m3 and multilingual-e5; ``nomic-bert``, nomic-embed-text v1 and v1.5):
an HF-style config, the tensors under their transformers names (dequantized to float32)
and the tokenizer (BERT's WordPiece, XLM-RoBERTa's Unigram or RoBERTa's byte-level BPE
vocabulary: `Tokenizer.from_gguf`).

llama.cpp's converter writes RoBERTa and XLM-RoBERTa checkpoints as ``bert`` too, with their
position rows already shifted to start at 0, so every file reads as a `BertModel`; a sequence
classifier (``cls.*`` tensors: XLM-RoBERTa's rerankers, bge-reranker-v2-m3) as a
`BertForSequenceClassification`, whose pooler and classifier compute RoBERTa's head. BERT's
own classifiers lose their pooler in the converter and are refused. A file does not say
its activation: BERT-style layers compute exact GELU, as their checkpoints do.
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
    # a classifier's head: dense, tanh, then the labels' rows (RoBERTa's classifier.dense
    # and out_proj), computed as BERT's pooler and classifier are
    "cls.weight": "pooler.dense.weight", "cls.bias": "pooler.dense.bias",
    "cls.output.weight": "classifier.weight", "cls.output.bias": "classifier.bias",
}
# general.architecture -> (HF architecture, a layer's tensors' names, their prefix)
_ARCHS = {
    "bert": ("BertModel", {
        "attn_q": "attention.self.query", "attn_k": "attention.self.key",
        "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"},
        "encoder.layer"),
    "nomic-bert": ("NomicBertModel", {
        "attn_qkv": "self_attn.qkv", "attn_output": "self_attn.o_proj",
        "attn_output_norm": "post_attention_layernorm", "ffn_up": "mlp.up_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
        "layer_output_norm": "post_mlp_layernorm"},
        "layers"),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(name: str, arch: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, layer_names, prefix = _ARCHS[arch]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} is not part of a {arch} encoder heron reads")
    return f"{prefix}.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def load_bert_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                              Tokenizer]:
    """(config, tensors, tokenizer) of the GGUF file at ``path``: ``config`` reads like a
    `BertModel`'s or `NomicBertModel`'s ``config.json``, ``tensors`` are float32 under
    the bare model's names (NomicBERT's q, k and v fused). ValueError for another
    architecture, a classifier without its dense layer or a vocabulary heron does not
    read."""
    reader = read_gguf(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if (arch := field("general.architecture")) not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not an encoder the bert family "
                         f"reads ({', '.join(_ARCHS)})")
    tensors = {_hf_name(t.name, arch): torch.from_numpy(dequantize_tensor(t))
               for t in reader.tensors}
    classifier = "classifier.weight" in tensors
    if classifier and "pooler.dense.weight" not in tensors:
        raise ValueError(f"{Path(path).name}: a classifier without the dense layer before its "
                         "labels' rows (llama.cpp's converter drops BERT's pooler); serve "
                         "the HF checkpoint")
    words = tensors["embeddings.word_embeddings.weight"]
    types = tensors.get("embeddings.token_type_embeddings.weight")
    positions = tensors.get("embeddings.position_embeddings.weight")
    config = {
        "architectures": [_ARCHS[arch][0].replace("Model", "ForSequenceClassification")
                          if classifier else _ARCHS[arch][0]],
        "vocab_size": words.shape[0],
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "layer_norm_eps": float(field(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
        "max_position_embeddings": (field(f"{arch}.context_length") if positions is None
                                    else positions.shape[0]),
        "type_vocab_size": 0 if types is None else types.shape[0],
        "pad_token_id": field("tokenizer.ggml.padding_token_id", 0),
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(field(f"{arch}.rope.freq_base", 1000.0))},
    }
    if types is None:  # a file without the type rows: every token is type 0 (none added)
        tensors["embeddings.token_type_embeddings.weight"] = torch.zeros(1, words.shape[1])
        config["type_vocab_size"] = 1
    return config, tensors, Tokenizer.from_gguf(reader, encoder=True)
