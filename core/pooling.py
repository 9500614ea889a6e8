"""Embeddings: a prompt in, one vector out, pooled from its tokens' final hidden states.

`resolve_pooling` decides from ``[model]`` and the checkpoint whether a model embeds, and
how; `Pooler` takes each sequence's rows as its prompt computes (in chunks, over several
steps) and gives the vector once the last row has come.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from heron.core.config import ConfigError, ModelConfig
from heron.core.sampling_params import SamplingParams

# sentence-transformers' Pooling config: the modes heron pools with (others are refused)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    method: str  # "last" | "mean" | "cls"
    normalize: bool

    @property
    def reads_every_row(self) -> bool:
        """Whether every prompt token's row counts: then a prefix-cache hit, whose rows
        are not computed, cannot be used."""
        return self.method != "last"


def _is_bare_model(path: Path) -> bool:
    """An HF checkpoint of a model without its LM head (architecture ``Qwen3Model``,
    ``LlamaModel``, ...), as embedding models are saved."""
    config = path / "config.json"
    if not config.is_file():
        return False
    arch = (json.loads(config.read_text()).get("architectures") or [""])[0]
    return arch.endswith("Model") and not arch.endswith("LMHeadModel")


def resolve_pooling(model: ModelConfig, path: Path) -> Pooling | None:
    """How the model at ``path`` pools its embeddings; None when it generates text.

    ``task = "auto"`` embeds a sentence-transformers checkpoint (``modules.json``) or a
    bare model, whose pooling and normalization then come from its modules unless
    ``[model]`` sets them. ConfigError for a bare model asked to generate, or a pooling
    mode heron does not implement."""
    modules = _st_modules(path)
    bare = _is_bare_model(path)
    task = model.task
    if task == "auto":
        task = "embed" if modules is not None or bare else "generate"
    if task == "generate":
        if bare:
            raise ConfigError(f"model.task = \"generate\": {path.name} is a bare model "
                              "without an LM head; it can only embed (model.task = \"embed\")")
        return None
    method = model.pooling
    if method == "auto":
        method = _st_pooling(path, modules) if modules is not None else "last"
    normalize = model.normalize
    if normalize is None:
        normalize = modules is None or any(m.get("type") == _ST_NORMALIZE for m in modules)
    return Pooling(method, normalize)


def _st_modules(path: Path) -> list[dict] | None:
    file = path / "modules.json"
    return json.loads(file.read_text()) if path.is_dir() and file.is_file() else None


def _st_pooling(path: Path, modules: list[dict]) -> str:
    module = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if module is None:
        return "last"
    config = json.loads((path / module.get("path", "") / "config.json").read_text())
    chosen = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(chosen) != 1 or chosen[0] not in _ST_MODES:
        raise ConfigError(f"{path.name}: its sentence-transformers Pooling module uses "
                          f"{', '.join(chosen) or 'no mode'}; heron pools with one of "
                          f"{', '.join(_ST_MODES)} (set model.pooling to override)")
    return _ST_MODES[chosen[0]]


class Pooler:
    """Pools sequences' hidden-state rows into their embeddings as their prompts compute.

    A sequence's rows come in order, a chunk per step; one starting at position 0 starts
    over (a sequence preempted and recomputed). With ``reads_every_row`` pooling no chunk
    may skip rows (no prefix-cache hits).
    """

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling
        self._partial: dict[int, torch.Tensor] = {}  # seq id -> sum of rows, or first row

    def feed(self, seq_id: int, rows: torch.Tensor, start: int,
             num_prompt_tokens: int) -> torch.Tensor | None:
        """Take the rows of prompt positions ``start ..`` (``[n, hidden]``); return the
        embedding (float32, on the CPU) once position ``num_prompt_tokens - 1`` is in."""
        method, end = self.pooling.method, start + rows.shape[0]
        if method == "mean":
            total = rows.float().sum(0)
            if start:
                total += self._partial[seq_id]
            self._partial[seq_id] = total
        elif method == "cls" and start == 0:
            self._partial[seq_id] = rows[0].float()
        if end < num_prompt_tokens:
            return None
        if method == "last":
            vector = rows[-1].float()
        else:
            vector = self._partial.pop(seq_id)
            if method == "mean":
                vector = vector / num_prompt_tokens
        if self.pooling.normalize:
            vector = F.normalize(vector, dim=-1)
        return vector.cpu()

    def forget(self, seq_id: int) -> None:
        """Drop what a sequence that ends unpooled (aborted, failed) left."""
        self._partial.pop(seq_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._partial)


def embedding_params(params: SamplingParams) -> SamplingParams:
    """What an embedding request runs with: its prompt and nothing to generate."""
    asks = [name for name, on in (("n", params.n != 1), ("num_beams", params.num_beams != 1),
                                  ("logprobs", params.logprobs is not None),
                                  ("prompt_logprobs", params.prompt_logprobs is not None),
                                  ("structured_outputs", params.structured_outputs is not None))
            if on]
    if asks:
        raise ValueError(f"an embedding model generates nothing: {', '.join(asks)} does not "
                         "apply")
    return SamplingParams(max_tokens=1, priority=params.priority)
