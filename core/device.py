"""Device and dtype selection: ``auto`` means CUDA when present, bf16 there, fp32 on CPU."""

from __future__ import annotations

import importlib.util

import torch

from heron.core.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(model: ModelConfig) -> tuple[torch.device, torch.dtype]:
    if model.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = \"cuda\" but torch sees no CUDA device")
    is_cuda = model.device == "cuda" or (model.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda") if is_cuda else torch.device("cpu")
    if is_cuda and importlib.util.find_spec("cupy") is None:
        raise RuntimeError("the CUDA backend needs CuPy: pip install 'heron[cuda]' (CUDA 12) "
                           "or 'heron[cuda13]' (CUDA 13), or set model.device = \"cpu\"")
    if model.dtype != "auto":
        return device, _DTYPES[model.dtype]
    return device, torch.bfloat16 if is_cuda else torch.float32
