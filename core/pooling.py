"""Embeddings: a prompt in, one vector out, pooled from its tokens' final hidden states.

`resolve_pooling` decides from ``[model]`` and the checkpoint whether a model embeds or
classifies, and how; `Pooler` takes each sequence's rows as its prompt computes (in
chunks, over several steps) and gives the vector once the last row has come. A
sequence-classification model's vector goes through its score head (the family's
`ModelRunner.classifier`): one logit a label, given as probabilities, softmax over the
labels, or the sigmoid of a lone label's logit (a cross-encoder's relevance), as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from heron.core.config import ConfigError, ModelConfig
from heron.core.gguf_header import read_gguf_header
from heron.core.sampling_params import SamplingParams

# sentence-transformers' Pooling config: the modes heron pools with (others are refused)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    method: str  # "last" | "mean" | "cls"; "auto" until the family's default is known
    normalize: bool
    labels: tuple[str, ...] = ()  # a classifier's, in the order of its logits; () embeds
    # the longest input the checkpoint embeds (sentence-transformers' `max_seq_length`):
    # the engine's max_model_len unless [model] sets one
    max_len: int | None = None
    # the widths a vector may be shortened to (Matryoshka): True any, False none
    matryoshka: bool | tuple[int, ...] = False

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    @property
    def reads_every_row(self) -> bool:
        """Whether every prompt token's row counts: then a prefix-cache hit, whose rows
        are not computed, cannot be used."""
        return self.method != "last"

    def check_dimensions(self, dimensions: int, width: int) -> None:
        """ValueError unless vectors of ``width`` may be shortened to ``dimensions`` (their
        own width always passes)."""
        if dimensions == width:
            return
        if dimensions > width:
            raise ValueError(f"`dimensions` is {dimensions}; this model's embeddings have "
                             f"{width}")
        if self.classifies or self.matryoshka is False:
            raise ValueError(f"`dimensions` is {dimensions}: this model's embeddings have "
                             f"{width} and were not trained to be shortened (a Matryoshka "
                             "model's are: model.matryoshka_dimensions)")
        if self.matryoshka is not True and dimensions not in self.matryoshka:
            raise ValueError(f"`dimensions` is {dimensions}; this model's embeddings may "
                             f"be shortened to {', '.join(map(str, self.matryoshka))}")

    def shorten(self, vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """``vector``'s first ``dimensions`` values (all with None), normalized again when
        this pooling normalizes (as vLLM and sentence-transformers' `truncate_dim` do)."""
        if dimensions is None or dimensions == vector.shape[-1]:
            return vector
        vector = vector[..., :dimensions]
        return F.normalize(vector, dim=-1) if self.normalize else vector


@dataclass(frozen=True)
class ScoreHead:
    """A sequence classifier's head over its pooled final hidden state ``v``: the labels'
    logits ``weight @ v + bias``, where a checkpoint has a layer first,
    ``v = norm(activation(dense @ v + dense_bias))`` (BERT's pooler and RoBERTa's head: tanh
    and no norm; ModernBERT's: GELU and a LayerNorm). Computed in the weights' dtype; the
    logits come back in float32."""

    weight: torch.Tensor  # [labels, hidden]
    bias: torch.Tensor | None = None
    dense: tuple[torch.Tensor, torch.Tensor | None] | None = None  # [hidden, hidden], [hidden]
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.tanh
    norm: tuple[torch.Tensor, torch.Tensor | None, float] | None = None  # weight, bias, eps

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        v = v.to(self.weight.dtype)
        if self.dense is not None:
            v = self.activation(F.linear(v, *self.dense))
            if self.norm is not None:
                weight, bias, eps = self.norm
                v = F.layer_norm(v, weight.shape, weight, bias, eps)
        return F.linear(v, self.weight, self.bias).float()


def _hf_config(path: Path) -> dict:
    config = path / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _architecture(config: dict) -> str:
    return (config.get("architectures") or [""])[0]


def _is_bare_model(arch: str) -> bool:
    """A model saved without its LM head (architecture ``Qwen3Model``, ``LlamaModel``...),
    as embedding models are."""
    return arch.endswith("Model") and not arch.endswith("LMHeadModel")


def _labels(config: dict) -> tuple[str, ...]:
    """A sequence-classification checkpoint's labels, by logit (its ``id2label``)."""
    names = config.get("id2label") or {}
    count = config.get("num_labels") or len(names) or 2  # transformers' default
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(count))


def resolve_pooling(model: ModelConfig, path: Path) -> Pooling | None:
    """How the model at ``path`` pools its embeddings; None when it generates text.

    ``task = "auto"`` embeds a sentence-transformers checkpoint (``modules.json``) or a
    bare model, whose pooling and normalization then come from its modules unless
    ``[model]`` sets them, and classifies with a sequence-classification checkpoint
    (not normalized, unless ``[model]`` says otherwise), as it does a causal LM given
    ``classifier_from_tokens``. A GGUF file embeds when it names a pooling type or is an
    encoder, pooled as it says, and classifies when it has a classifier's rows
    (`_gguf_pooling`). Where neither ``[model]`` nor the modules name the pooling,
    it is "auto": the loaded family's `ModelRunner.default_pooling`. ConfigError for a
    model without an LM head asked to generate, one without a score head asked to
    classify, or a pooling mode heron does not implement."""
    modules = _st_modules(path)
    config = _hf_config(path)
    arch = _architecture(config)
    gguf_method, gguf_labels = _gguf_pooling(path)
    bare = _is_bare_model(arch) or (gguf_method is not None and not gguf_labels)
    classifier = arch.endswith("ForSequenceClassification") or bool(gguf_labels)
    from_tokens = model.classifier_from_tokens
    task = model.task
    if task == "auto":
        task = ("classify" if classifier or from_tokens else
                "embed" if modules is not None or bare else "generate")
    if from_tokens and (task != "classify" or bare or classifier):
        raise ConfigError("model.classifier_from_tokens makes a causal LM's LM head classify "
                          f"(model.task = \"classify\"); {path.name} "
                          + ("has no LM head" if bare or classifier
                             else f"is served with model.task = \"{task}\""))
    if task == "generate":
        if bare or classifier:
            raise ConfigError(f"model.task = \"generate\": {path.name} is a model without an "
                              f"LM head; it can only {'classify' if classifier else 'embed'} "
                              f"(model.task = \"{'classify' if classifier else 'embed'}\")")
        return None
    if task == "classify":
        if from_tokens:  # two tokens [no, yes]: one label, the second's probability
            labels = tuple(from_tokens[1:] if len(from_tokens) == 2 else from_tokens)
        elif classifier:
            labels = gguf_labels or _labels(config)
        else:
            raise ConfigError(f"model.task = \"classify\": {path.name} is a {arch or 'model'}"
                              ", not a sequence-classification checkpoint (architecture "
                              "`...ForSequenceClassification`) with a score head, and "
                              "model.classifier_from_tokens is unset")
        return Pooling(model.pooling, bool(model.normalize), labels)
    method = model.pooling
    if method == "auto" and modules is not None:
        method = _st_pooling(path, modules)
    if method == "auto" and gguf_method is not None:
        method = gguf_method
    normalize = model.normalize
    if normalize is None:
        normalize = modules is None or any(m.get("type") == _ST_NORMALIZE for m in modules)
    return Pooling(method, normalize, max_len=_st_max_len(path) if modules is not None else None,
                   matryoshka=_matryoshka(model, config))


def _matryoshka(model: ModelConfig, config: dict) -> bool | tuple[int, ...]:
    """The widths ``[model]`` or the checkpoint's config allow vectors to be shortened to."""
    widths = model.matryoshka_dimensions
    if widths is None:
        widths = config.get("matryoshka_dimensions") or bool(config.get("is_matryoshka"))
    return widths if isinstance(widths, bool) else tuple(sorted(set(widths)))


# llama.cpp's `{arch}.pooling_type`, which its converter writes for embedding models
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def _gguf_pooling(path: Path) -> tuple[str | None, tuple[str, ...]]:
    """How the embedding model of a GGUF file pools (its ``pooling_type``; "auto" for an
    encoder, ``attention.causal`` false, that names none; None for a generating model), and
    a sequence classifier's labels, for a file with a classifier's rows (``cls.output``):
    its ``classifier.output_labels``, which llama.cpp's converter writes unless they are
    transformers' defaults, ``LABEL_0`` ... (as many as the rows)."""
    if not (path.is_file() and path.suffix == ".gguf"):
        return None, ()
    metadata, shapes = read_gguf_header(path)
    arch = metadata.get("general.architecture")
    rows = shapes.get("cls.output.weight", (0, 0))[1]
    labels = tuple(metadata.get(f"{arch}.classifier.output_labels")
                   or (f"LABEL_{i}" for i in range(rows)))
    kind = metadata.get(f"{arch}.pooling_type")
    if kind == 4 and not labels:
        raise ConfigError(f"{path.name}: pooling_type rank, but no classifier's rows "
                          "(cls.output) to rank with")
    causal = metadata.get(f"{arch}.attention.causal") is not False
    if causal and len(labels) == 2:
        # a decoder's rank head of two rows, [yes, no] (llama.cpp's Qwen3-Reranker files),
        # ranks by the first's probability against the second: one label (the
        # transformer family's loader makes their difference its row)
        labels = labels[:1]
    if kind in _GGUF_POOLING:
        return _GGUF_POOLING[kind], labels
    return ("auto" if not causal or labels else None), labels


def _st_modules(path: Path) -> list[dict] | None:
    file = path / "modules.json"
    return json.loads(file.read_text()) if path.is_dir() and file.is_file() else None


def _st_max_len(path: Path) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json``: sentence-transformers cuts
    longer inputs there (all-MiniLM's 256, of 512 positions)."""
    file = path / "sentence_bert_config.json"
    return json.loads(file.read_text()).get("max_seq_length") if file.is_file() else None


def _st_pooling(path: Path, modules: list[dict]) -> str:
    module = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if module is None:
        return "auto"
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

    def __init__(self, pooling: Pooling, classifier: ScoreHead | None = None) -> None:
        """``classifier``: the score head a classifying ``pooling`` needs."""
        if pooling.classifies and (classifier is None
                                   or classifier.num_labels != len(pooling.labels)):
            raise ValueError(f"a classifier of {len(pooling.labels)} labels needs a score "
                             f"head of as many rows; the model has "
                             f"{'none' if classifier is None else classifier.num_labels}")
        self.pooling = pooling
        self.classifier = classifier
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
        if self.pooling.classifies:
            logits = self.classifier(vector.to(self.classifier.weight.device))
            vector = logits.sigmoid() if logits.numel() == 1 else logits.softmax(-1)
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
