"""Loading a llama.cpp GGUF file as an HF-style config, float32 state dict and tokenizer.

Every tensor is dequantized to float32 with `gguf.quants.dequantize` (whatever quantization
types the installed `gguf` can dequantize), renamed to its transformers name, and for the
``llama`` architecture the q/k projection rows are un-permuted: llama.cpp's converter
interleaves each head's rotary halves (`LlamaModel.permute` in convert_hf_to_gguf.py),
Qwen2/Qwen3 converters do not. With that, the tensors equal what transformers' own GGUF
loader produces, value for value.

Contract of `load_gguf(path) -> (hf_config, state_dict, tokenizer)`:
  - ``hf_config`` reads like a transformers ``config.json`` for LlamaForCausalLM /
    MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM;
  - ``state_dict`` maps transformers names to fresh, writable, contiguous float32 CPU
    tensors in the transformers shapes; ``lm_head.weight`` is absent when the embeddings are
    tied (``tie_word_embeddings``);
  - ``tokenizer`` is a `heron.core.tokenizer.Tokenizer`, or None (with a warning) when the
    file has no tokenizer heron can build;
  - an unknown architecture, tensor name or quantization type raises ValueError naming it.

With ``keep_quantized``, projection weights (and the LM head, tied or not) of the types
`heron.core.ops.quantized` multiplies (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K-Q6_K, IQ4_NL,
IQ4_XS) stay in their blocks as `QuantizedWeight`s where its kernel builds; the embeddings
stay float32 as well, since a lookup reads them row by row.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from heron.core.model_loader import read_gguf
from heron.core.ops.quantized import QuantizedWeight, kernel_available
from heron.core.tokenizer import Tokenizer

__all__ = ["dequantize_tensor", "gguf_config", "hf_name", "load_gguf"]

log = logging.getLogger(__name__)

# general.architecture -> (HF architecture, model_type, q/k stored permuted)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),  # NoPE every fourth layer
    "phi3": ("Phi3ForCausalLM", "phi3", False),  # q/k/v and gate/up fused
    "granite": ("GraniteForCausalLM", "granite", True),  # and its multipliers
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "cls.output.weight": "score.weight",  # a reranker's (llama.cpp's Qwen3-Reranker files)
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2's norms after
    "post_ffw_norm": "post_feedforward_layernorm",
}
# architectures whose files name some layer tensors otherwise: Phi-3's ffn_up is gate and up
_ARCH_LAYER_NAMES = {"phi3": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed rotary frequency factors (Llama 3.1 rope scaling); transformers ignores them too.
_IGNORED = ("rope_freqs.weight",)
# LongRoPE's factors (Phi-3.5, Phi-4-mini), which switch with the context's length
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _uniform(value: Any, key: str) -> Any:
    """Some files store per-layer lists (e.g. head counts); heron needs one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {key} varies per layer ({value}); not supported")
        return value[0]
    return value


def gguf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A transformers-style config dict from the file's metadata (see module docstring)."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})")
    hf_arch, model_type, _ = _ARCHS[arch]
    names = {t.name for t in reader.tensors}
    if names & set(_LONGROPE):
        raise ValueError("this file's rope is LongRoPE (rope_factors_long / _short: Phi-3.5, "
                         "Phi-4-mini), which heron does not serve")
    ranks = "cls.output.weight" in names
    if ranks:  # a sequence classifier: the engine pools it (`heron.core.pooling`)
        hf_arch = hf_arch.removesuffix("ForCausalLM") + "ForSequenceClassification"

    def key(name: str, default: Any = None) -> Any:
        return _uniform(_field(reader, f"{arch}.{name}", default), f"{arch}.{name}")

    hidden, heads = key("embedding_length"), key("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    theta = float(key("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length") or hidden // heads,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": key("context_length", 2048),
        "vocab_size": key("vocab_size") or (len(tokens.data) if tokens else int(embd.shape[1])),
        # llama.cpp writes output.weight only when it differs from the embeddings (and
        # none for a reranker, whose head is cls.output)
        "tie_word_embeddings": "output.weight" not in names and not ranks,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    for gguf_key, name in (("embedding_scale", "embedding_multiplier"),
                           ("residual_scale", "residual_multiplier"),
                           ("attention.scale", "attention_multiplier"),
                           ("logit_scale", "logits_scaling")):  # Granite's
        if (value := key(gguf_key)) is not None:
            config[name] = float(value)
    rotated = key("rope.dimension_count")
    if rotated and rotated != config["head_dim"]:  # Phi's partial rotary
        config["partial_rotary_factor"] = rotated / config["head_dim"]
    if window := key("attention.sliding_window"):  # Phi-3's; 0 for none (Phi-4)
        config["sliding_window"] = window
        if pattern := _field(reader, f"{arch}.attention.sliding_window_pattern"):
            config["layer_types"] = ["sliding_attention" if windowed else "full_attention"
                                     for windowed in pattern]
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        rope = {"rope_type": scaling, "rope_theta": theta, "factor": float(key("rope.scaling.factor", 1.0))}
        if (orig := key("rope.scaling.original_context_length")) is not None:
            rope["original_max_position_embeddings"] = orig
        # YaRN's settings as the converter writes transformers' (yarn_attn_factor is their
        # attention_factor, which llama.cpp's older files call attn_factor)
        for gguf_key, name in (("attn_factor", "attention_factor"),
                               ("yarn_attn_factor", "attention_factor"),
                               ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := key(f"rope.scaling.{gguf_key}")) is not None:
                rope[name] = float(value)
        config["rope_parameters"] = rope
        config["rope_scaling"] = dict(rope)
    if arch == "olmo2" and "layer_types" in config:
        # OLMo 3's files: the scaling is its full layers', the windowed ones rotate plainly
        # (at rope.freq_base_swa), as llama.cpp runs them
        config["architectures"], config["model_type"] = ["Olmo3ForCausalLM"], "olmo3"
        config["rope_parameters"] = {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(key("rope.freq_base_swa", theta))}}
    if arch != "qwen2" and "blk.0.attn_q.bias" in names:
        config["attention_bias"] = True  # qwen2 always has q/k/v bias; its config has no flag
    return config


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A `gguf.ReaderTensor` as a fresh, writable, C-contiguous float32 array in the HF
    (row-major, reversed GGUF ``shape``) layout."""
    try:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F64:  # gguf has no F64 dequantizer
            w = np.asarray(tensor.data, dtype=np.float32)
        else:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name!r}: quantization type "
                         f"{tensor.tensor_type.name} cannot be dequantized by gguf "
                         f"{getattr(gguf, '__version__', '')}".rstrip()) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # F32 (and F16 viewed) data comes back as a view of the read-only memmap: copy it.
    w = np.require(w, np.float32, ["C", "W", "O"])
    return w.reshape(shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave: (head, 2, dim/2) -> (head, dim/2, 2) order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str, outer: dict[str, str], layer_names: dict[str, str], prefix: str) -> str:
    """A GGUF tensor's transformers name: ``outer[name]`` outside the layers, layer i's
    ``blk.{i}.{kind}.weight`` as ``{prefix}.{i}.{layer_names[kind]}.weight``. ValueError
    for a tensor of neither."""
    if name in outer:
        return outer[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} is not part of a model heron reads")
    return f"{prefix}.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _load_tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer | None:
    if "tokenizer.ggml.tokens" not in reader.fields:
        log.warning("%s has no tokenizer; requests must send token ids", path.name)
        return None
    try:
        return Tokenizer.from_gguf(reader)
    except ValueError as exc:
        log.warning("%s: no tokenizer (%s); requests must send token ids", path.name, exc)
        return None


def _kept(tensor: Any, int8_activations: bool) -> QuantizedWeight | None:
    """``tensor``'s blocks as a `QuantizedWeight`, if its type has a kernel here."""
    qtype = int(tensor.tensor_type)
    if len(tensor.shape) != 2 or not kernel_available(qtype):
        return None
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C"))
    return QuantizedWeight(blocks, qtype, int(tensor.shape[0]), int8_activations)


def load_gguf(path: str | Path, keep_quantized: bool = False, int8_activations: bool = False
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor | QuantizedWeight], Tokenizer | None]:
    """Read, dequantize (see ``keep_quantized`` above) and rename everything in the GGUF
    file at ``path``; kept weights multiply small batches with ``int8_activations``
    (`QuantizedWeight`)."""
    path = Path(path)
    reader = read_gguf(path)
    config = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    permuted = _ARCHS[arch][2]
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    n_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    state_dict: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor",
               disable=not sys.stderr.isatty())
    for tensor in bar:
        if tensor.name in _IGNORED:
            log.warning("%s: ignoring %s (not used by heron)", path.name, tensor.name)
            continue
        name = hf_name(tensor.name, _GLOBAL_NAMES, layer_names, "model.layers")
        proj = name.split(".")[-2]
        tied_head = name == "model.embed_tokens.weight" and config["tie_word_embeddings"]
        kept = _kept(tensor, int8_activations) if keep_quantized and (
            name.endswith("_proj.weight") or name == "lm_head.weight" or tied_head) else None
        if kept is not None and tied_head:
            state_dict["lm_head.weight"] = kept
            kept = None  # the lookup itself reads float32 rows
        if kept is not None:
            if permuted and proj in n_heads:  # whole rows move: blocks as values
                kept.blocks = torch.from_numpy(np.ascontiguousarray(
                    _unpermute(kept.blocks.numpy(), n_heads[proj])))
            state_dict[name] = kept
            continue
        w = dequantize_tensor(tensor)
        if permuted and proj in n_heads:
            w = _unpermute(w, n_heads[proj])
        state_dict[name] = torch.from_numpy(np.ascontiguousarray(w))
    if (score := state_dict.get("score.weight")) is not None and len(score) == 2:
        # llama.cpp's rank head of two rows, [yes, no], scores by their softmax's first
        # probability: one label, whose sigmoid is that (`heron.core.pooling._gguf_pooling`)
        state_dict["score.weight"] = (score[0] - score[1])[None]
    kept = [t for t in state_dict.values() if isinstance(t, QuantizedWeight)]
    if kept:
        log.info("%s: %d weights kept quantized, %.0f MB (%.0f MB as float32)", path.name,
                 len(kept), sum(t.blocks.numel() for t in kept) / 2**20,
                 sum(t.shape.numel() * 4 for t in kept) / 2**20)
    return config, state_dict, _load_tokenizer(reader, path)
