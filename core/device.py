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


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a list, or a CPU tensor of ``dtype``) as a tensor on ``device``, without
    waiting for the device: on CUDA through pinned memory, so that the copy is queued on the
    stream while the host goes on (one from pageable memory may wait for the stream's work
    to finish, which would stall the host behind the step it means to overlap)."""
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype)
    if isinstance(data, torch.Tensor):
        return data.pin_memory().to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
