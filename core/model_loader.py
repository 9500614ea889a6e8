"""Finds the family that serves a model path and loads it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from heron.core.chat_template import read_chat_template
from heron.core.config import ModelConfig
from heron.core.family import LoadedModel
from heron.core.gguf_header import read_gguf_value
from heron.core.plugins import PluginManager, load_family
from heron.core.pooling import resolve_pooling


def resolve_model_path(model: ModelConfig) -> Path:
    """The configured path, or the default model (fetched on first use)."""
    if model.path is not None:
        path = Path(model.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        return path
    from heron.core.default_model import ensure_default_model
    return ensure_default_model()


def detect_architecture(path: Path) -> dict[str, str]:
    """``{"architecture": ...}`` for an HF directory, ``{"gguf_architecture": ...}`` for GGUF."""
    if path.is_file() and path.suffix == ".gguf":
        return {"gguf_architecture": read_gguf_value(path, "general.architecture")}
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{str(path)!r} is neither a .gguf file nor a directory "
                                "with config.json")
    architectures = json.loads(config_file.read_text()).get("architectures") or [None]
    return {"architecture": architectures[0]}


class ModelLoadError(ValueError):
    """A model's files could not be read: the message names the path and what is wrong."""


def load_model(model: ModelConfig, plugins: PluginManager, device: torch.device,
               dtype: torch.dtype) -> LoadedModel:
    path = resolve_model_path(model)
    # read before the weights, so that a missing file fails at once
    template = read_chat_template(model.chat_template) if model.chat_template else None
    try:
        pooling = resolve_pooling(model, path)
        spec = (plugins.family_for(name=model.family) if model.family
                else plugins.family_for(**detect_architecture(path)))
        loaded = load_family(spec)(str(path), model, device, dtype)
        if template is not None:
            if loaded.tokenizer is None:
                raise ModelLoadError(f"{path}: model.chat_template needs the model's "
                                     "tokenizer, and it has none")
            # a cross-encoder's pairs go through it too (vLLM's score templates)
            loaded.tokenizer.chat_template = loaded.tokenizer.score_template = template
        if pooling is not None and pooling.method == "auto":
            pooling = dataclasses.replace(pooling, method=loaded.runner.default_pooling)
        loaded.pooling = pooling
        return loaded
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: a JSON file is not valid JSON ({e})") from e
    except SafetensorError as e:
        raise ModelLoadError(f"{path}: a safetensors file is unreadable ({e})") from e


def read_gguf(path: str | Path):
    """A `gguf.GGUFReader` of ``path``; a file cut short fails here with a ModelLoadError,
    not with what numpy says when a tensor's bytes are missing."""
    import gguf
    path = Path(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as e:
        raise ModelLoadError(f"{path}: not a complete GGUF file ({path.stat().st_size} bytes; "
                             f"{e})") from e
