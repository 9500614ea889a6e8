"""Configuration: TOML files decoded into msgspec Structs, with ``--set`` style overrides.

Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the file and
the key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration problem, with the file and key it came from in the message."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def __post_init__(self) -> None:
        for name, ok, why in self._checks():
            if not ok:
                raise ValueError(f"`{name}` {why} (got {getattr(self, name)!r})")

    def _checks(self) -> tuple[tuple[str, bool, str], ...]:
        return ()


class ModelConfig(_Section):
    path: str | None = None
    family: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = None
    num_threads: int | None = None

    def _checks(self):
        return (("max_model_len", self.max_model_len is None or self.max_model_len >= 1,
                 "must be >= 1"),
                ("num_threads", self.num_threads is None or self.num_threads >= 1,
                 "must be >= 1"))


class EngineConfig(_Section):
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    cuda_graphs: bool = True

    def _checks(self):
        return (
            ("block_size", 1 <= self.block_size <= 1024, "must be in 1..1024"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             "must be >= 1"),
            ("kv_cache_memory_gb", self.kv_cache_memory_gb > 0, "must be > 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
        )


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"--set {dotted}: `{part}` is not a section")
    tree[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"section.key=value"`` → ``("section.key", value)``; the value is a TOML literal,
    and a bare word that is not valid TOML is taken as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] = ()) -> Config:
    """Read ``path`` (or the defaults when None), apply overrides, validate, return a Config."""
    source = str(path) if path is not None else "<defaults>"
    try:
        tree = tomllib.loads(Path(path).read_text()) if path is not None else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides)
    for key, value in items:
        _set_dotted(tree, key, value)
    try:
        return msgspec.convert(tree, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
