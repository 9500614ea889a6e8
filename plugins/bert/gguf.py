"""Reads an encoder from a llama.cpp GGUF file (architecture ``bert``, as its converter
writes bge, e5, all-MiniLM, mxbai-embed and snowflake-arctic-embed, and XLM-RoBERTa's bge-m3
and multilingual-e5; ``nomic-bert``, nomic-embed-text v1 and v1.5; ``modern-bert``):
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

from pathlib import Path
from typing import Any

import torch

from heron.core import Tokenizer
from heron.core.model_loader import read_gguf
from heron.plugins.transformer.gguf_loader import dequantize_tensor, hf_name

# BERT's and NomicBERT's tensors outside their layers
_BERT_NAMES = {
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
_MODERNBERT_NAMES = {
    "token_embd.weight": "embeddings.tok_embeddings.weight",
    "token_embd_norm.weight": "embeddings.norm.weight",
    "token_embd_norm.bias": "embeddings.norm.bias",
    "output_norm.weight": "final_norm.weight", "output_norm.bias": "final_norm.bias",
    "cls.weight": "head.dense.weight", "cls.bias": "head.dense.bias",
    "cls.norm.weight": "head.norm.weight", "cls.norm.bias": "head.norm.bias",
    "cls.output.weight": "classifier.weight", "cls.output.bias": "classifier.bias",
}
# general.architecture -> (HF architecture, the tensors outside its layers, a layer's
# tensors, their prefix)
_ARCHS = {
    "bert": ("BertModel", _BERT_NAMES, {
        "attn_q": "attention.self.query", "attn_k": "attention.self.key",
        "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"},
        "encoder.layer"),
    "nomic-bert": ("NomicBertModel", _BERT_NAMES, {
        "attn_qkv": "self_attn.qkv", "attn_output": "self_attn.o_proj",
        "attn_output_norm": "post_attention_layernorm", "ffn_up": "mlp.up_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
        "layer_output_norm": "post_mlp_layernorm"},
        "layers"),
    "modern-bert": ("ModernBertModel", _MODERNBERT_NAMES, {
        "attn_norm": "attn_norm", "attn_qkv": "attn.Wqkv", "attn_output": "attn.Wo",
        "ffn_norm": "mlp_norm", "ffn_up": "mlp.Wi", "ffn_down": "mlp.Wo"},
        "layers"),
}
# llama.cpp's pooling types a ModernBERT classifier pools with
_CLASSIFIER_POOLING = {1: "mean", 2: "cls"}


def load_bert_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                              Tokenizer]:
    """(config, tensors, tokenizer) of the GGUF file at ``path``: ``config`` reads like a
    `BertModel`'s, `NomicBertModel`'s or `ModernBertModel`'s ``config.json`` (or their
    classifiers'), ``tensors`` are float32 under the model's names (NomicBERT's q, k and v
    fused). ValueError for another architecture, a BERT classifier without its dense
    layer or a vocabulary heron does not read."""
    reader = read_gguf(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if (arch := field("general.architecture")) not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not an encoder the bert family "
                         f"reads ({', '.join(_ARCHS)})")
    hf_arch, outer, layer_names, prefix = _ARCHS[arch]
    tensors = {hf_name(t.name, outer, layer_names, prefix): torch.from_numpy(dequantize_tensor(t))
               for t in reader.tensors}
    classifier = "classifier.weight" in tensors
    if classifier and arch != "modern-bert" and "pooler.dense.weight" not in tensors:
        raise ValueError(f"{Path(path).name}: a classifier without the dense layer before its "
                         "labels' rows (llama.cpp's converter drops BERT's pooler); serve "
                         "the HF checkpoint")
    config = {
        "architectures": [hf_arch.replace("Model", "ForSequenceClassification")
                          if classifier else hf_arch],
        "vocab_size": tensors[outer["token_embd.weight"]].shape[0],
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id", 0),
    }
    if arch == "modern-bert":
        config.update(
            norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            local_attention=field(f"{arch}.attention.sliding_window", 128),
            global_attn_every_n_layers=field(f"{arch}.attention.sliding_window_pattern", 3),
            global_rope_theta=float(field(f"{arch}.rope.freq_base", 160000.0)),
            local_rope_theta=float(field(f"{arch}.rope.freq_base_swa", 10000.0)),
            hidden_activation=field(f"{arch}.hidden_activation", "gelu"),
            classifier_pooling=_CLASSIFIER_POOLING.get(
                field(f"{arch}.classifier.pooling_type"), "cls"))
    else:
        types = tensors.get("embeddings.token_type_embeddings.weight")
        positions = tensors.get("embeddings.position_embeddings.weight")
        config.update(
            layer_norm_eps=float(field(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
            type_vocab_size=0 if types is None else types.shape[0],
            rope_parameters={"rope_type": "default",
                             "rope_theta": float(field(f"{arch}.rope.freq_base", 1000.0))})
        if positions is not None:
            config["max_position_embeddings"] = positions.shape[0]
    return config, tensors, Tokenizer.from_gguf(reader, encoder=True)
