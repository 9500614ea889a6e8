"""PEFT LoRA adapters: a directory with ``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes it.

Contract of `load_adapter(name, path, targets, max_rank)`:
  - returns an `AdapterWeights` with float32, contiguous host tensors: per target and layer
    ``A [rank, in_features]`` and ``B [out_features, rank]``, None for layers the adapter
    leaves alone; targets it never touches are absent.
  - ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). With
    ``rank_pattern`` / ``alpha_pattern`` modules differ in rank and scaling: then every
    module is zero-padded to the largest rank, its own scaling is folded into its B and
    ``scaling`` is 1.0, so ``scaling * B @ A`` is still each module's exact delta.
  - anything heron cannot apply exactly raises `AdapterError` ("adapter 'x': problem"):
    missing files, an unreadable config or weights file, a rank above ``max_rank``, a
    module the base model does not offer as a target, tensor shapes that do not fit the
    base, a layer index out of range, and PEFT features heron does not implement (DoRA,
    biases, ``modules_to_save``, embedding / ``lm_head`` targets...).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from heron.core.lora import AdapterError, AdapterWeights, LoraTarget

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT config keys for features whose effect heron does not apply: a truthy value refuses
# the adapter, since serving it without the feature would give silently wrong outputs.
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on bare parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
}
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings",
                               "embed_out", "output"})
# base_model.model.<module path>.lora_A.weight; the module path holds "layers.<i>."
TENSOR_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_adapter(name: str, path: str, targets: tuple[LoraTarget, ...],
                 max_rank: int) -> AdapterWeights:
    """Read the PEFT adapter in directory ``path`` for a base model offering ``targets``."""
    def fail(problem: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {problem}")

    directory = Path(path)
    config = _read_config(directory, fail)
    r, alpha, rslora = _check_config(config, targets, fail)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        extra = (" (adapter_model.bin is not supported; save with safetensors)"
                 if (directory / "adapter_model.bin").exists() else "")
        raise fail(f"{weights_path} does not exist{extra}")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}

    def module_rank_scaling(module: str) -> tuple[int, float]:
        module_r = rank_pattern.get(_pattern_key(rank_pattern, module), r)
        module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha)
        return module_r, module_alpha / (math.sqrt(module_r) if rslora else module_r)

    pairs = _read_pairs(weights_path, {t.name: t for t in targets}, module_rank_scaling,
                        max_rank, fail)
    rank = max(pair_r for _, _, pair_r, _ in pairs.values())
    patterned = bool(rank_pattern or alpha_pattern)
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for (target, layer), (a, b, _, scale) in sorted(pairs.items()):
        if patterned:  # pad to one rank, fold this module's scaling into B
            a = torch.nn.functional.pad(a, (0, 0, 0, rank - a.shape[0]))
            b = torch.nn.functional.pad(b * scale, (0, rank - b.shape[1]))
        num_layers = next(t.num_layers for t in targets if t.name == target)
        layers.setdefault(target, [None] * num_layers)[layer] = (a.contiguous(), b.contiguous())
    scaling = 1.0 if patterned else alpha / (math.sqrt(r) if rslora else r)
    return AdapterWeights(name=name, path=str(path), rank=rank, scaling=scaling, layers=layers)


def _read_config(directory: Path, fail) -> dict:
    if not directory.is_dir():
        raise fail(f"{directory} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise fail(f"{config_path} does not exist")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise fail(f"{config_path} is not a JSON object")
    return config


def _check_config(config: dict, targets: tuple[LoraTarget, ...], fail) -> tuple[int, float, bool]:
    """``(r, lora_alpha, use_rslora)`` once the config asks for nothing heron cannot do."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, problem in UNSUPPORTED.items():
        if config.get(key):
            raise fail(problem)
    bias = config.get("bias", "none")
    if bias != "none":
        raise fail(f"bias={bias!r} is not supported (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise fail(f"r must be a positive integer, not {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise fail(f"lora_alpha must be a number, not {alpha!r}")
    _check_patterns(config, fail)
    modules = config.get("target_modules")
    offered = sorted(t.name for t in targets)
    if isinstance(modules, list):  # PEFT matches a list entry against module-name suffixes
        for module in modules:
            _check_module(str(module).rsplit(".", 1)[-1], offered, fail)
    elif not isinstance(modules, str):  # a string is a regex or "all-linear": tensors decide
        raise fail(f"target_modules must be a list or a string, not {modules!r}")
    return r, float(alpha), bool(config.get("use_rslora", False))


def _check_patterns(config: dict, fail) -> None:
    """``rank_pattern`` / ``alpha_pattern``: regex keys, a positive integer rank or a
    number alpha each."""
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise fail(f"{key} must be an object")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise fail(f"{key} key {pattern!r} is not a regular expression: {e}") from None
            rank = key == "rank_pattern"
            if (isinstance(value, bool) or not isinstance(value, int if rank else (int, float))
                    or (rank and value < 1)):
                what = "a positive integer" if rank else "a number"
                raise fail(f"{key}[{pattern!r}] must be {what}, not {value!r}")


def _check_module(module: str, offered: list[str], fail) -> None:
    if module in EMBEDDING_MODULES:
        raise fail(f"targets {module!r}: embedding and lm_head adapters are not supported")
    if module not in offered:
        raise fail(f"targets module {module!r}, which the base model does not offer "
                   f"(it offers {', '.join(offered)})")


def _read_pairs(weights_path: Path, by_name: dict[str, LoraTarget], module_rank_scaling,
                max_rank: int, fail) -> dict[tuple[str, int], tuple]:
    """``{(target, layer): (A, B, r, scaling)}`` from the weights file, every shape checked."""
    from safetensors import SafetensorError, safe_open

    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    ranks: dict[tuple[str, int], tuple[int, float]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                module, ab = _parse_key(key, fail)
                layer_match = LAYER_INDEX.search(module + ".")
                target_name = module.rsplit(".", 1)[-1]
                _check_module(target_name, sorted(by_name), fail)
                if layer_match is None:
                    raise fail(f"tensor {key} is not in a numbered layer")
                target, layer = by_name[target_name], int(layer_match.group(1))
                if layer >= target.num_layers:
                    raise fail(f"tensor {key} is for layer {layer}, but the base model has "
                               f"{target.num_layers} layers")
                r, scale = module_rank_scaling(module)
                if r > max_rank:
                    raise fail(f"rank {r} of {module} exceeds lora.max_rank {max_rank}")
                expected = ([r, target.in_features] if ab == "A"
                            else [target.out_features, r])
                shape = list(f.get_slice(key).get_shape())
                if shape != expected:
                    raise fail(f"tensor {key} has shape {shape}, expected {expected} "
                               f"(rank {r}, {target.name} {target.in_features} -> "
                               f"{target.out_features} in the base model)")
                halves.setdefault((target.name, layer), {})[ab] = f.get_tensor(key).float()
                ranks[(target.name, layer)] = (r, scale)
    except SafetensorError as e:
        raise fail(f"cannot read {weights_path}: {e}") from None
    if not halves:
        raise fail(f"{weights_path} holds no LoRA weights")
    for (target, layer), half in halves.items():
        if len(half) != 2:
            missing = "lora_B" if "A" in half else "lora_A"
            raise fail(f"{target} of layer {layer} has no {missing} weight")
    return {k: (h["A"], h["B"], *ranks[k]) for k, h in halves.items()}


def _parse_key(key: str, fail) -> tuple[str, str]:
    match = TENSOR_KEY.match(key)
    if match is not None:
        return match["module"], match["ab"]
    if "lora_magnitude_vector" in key:
        raise fail(f"tensor {key} is a DoRA magnitude; DoRA is not supported")
    if "lora_embedding_" in key:
        raise fail(f"tensor {key} adapts an embedding; embedding adapters are not supported")
    if key.endswith(".bias"):
        raise fail(f"tensor {key} is a bias; biases are not supported")
    raise fail(f"unexpected tensor {key} (not base_model.model.<module>.lora_A/B.weight)")


def _pattern_key(patterns: dict, module: str) -> str | None:
    """The first ``rank_pattern`` / ``alpha_pattern`` key matching ``module``, as PEFT's
    ``get_pattern_key`` picks it (a regex matching a dotted suffix of the module path)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None
