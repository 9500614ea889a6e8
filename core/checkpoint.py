"""Reads HF checkpoints: safetensors weights, single file or sharded with an index."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files (``model_dir`` may be one ``.safetensors`` file)."""
    if model_dir.is_file():
        return [model_dir]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {str(model_dir)!r}")
    return files


def load_safetensors(model_dir: Path, dtype: torch.dtype,
                     keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (those whose names ``keep`` accepts), cast to
    ``dtype``, on the CPU; integer tensors keep their type."""
    tensors: dict[str, torch.Tensor] = {}
    files = safetensors_files(model_dir)
    with tqdm(total=len(files), desc="loading weights", unit="file",
              disable=not sys.stderr.isatty()) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        t = f.get_tensor(name)
                        tensors[name] = t.to(dtype) if t.is_floating_point() else t
            bar.update()
    return tensors


_LAYER = re.compile(r"(?:model|backbone)\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """A multi-token-prediction module's tensor, which speculative drafting reads and the
    model does not: a layer past the model's last (DeepSeek-V3) or under ``mtp.``
    (Qwen3-Next)."""
    m = _LAYER.match(name)
    return name.startswith("mtp.") or (m is not None and int(m.group(1)) >= num_layers)
