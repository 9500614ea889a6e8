"""Reads a GGUF header without the tensors' data: single metadata values, or all of them
with the tensors' shapes.

`gguf.GGUFReader` parses every field (a 49k-token vocabulary takes seconds); picking a
model family only needs ``general.architecture``, usually the first key, and deciding what
a model serves a few more keys and tensor names (a tenth of a second for such a vocabulary).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        return [_value(f, item_kind) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {kind}")


def _items(f: BinaryIO, path: str | Path):
    """(key, value) of each metadata entry, in order, then the tensor count."""
    if f.read(4) != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file")
    _read(f, "<I")  # version
    tensors = _read(f, "<Q")
    for _ in range(_read(f, "<Q")):
        name = _value(f, _STRING)
        yield name, _value(f, _read(f, "<I"))
    yield None, tensors


def read_gguf_value(path: str | Path, key: str) -> Any:
    """The value of metadata ``key``, or KeyError. Stops reading at the key."""
    with open(path, "rb") as f:
        for name, value in _items(f, path):
            if name == key:
                return value
    raise KeyError(f"GGUF file {str(path)!r} has no metadata key {key!r}")


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Every metadata value by key, and every tensor's shape by name (as gguf writes it:
    the fastest-varying dimension first)."""
    with open(path, "rb") as f:
        metadata = dict(_items(f, path))
        shapes = {}
        for _ in range(metadata.pop(None)):
            name = _value(f, _STRING)
            shapes[name] = tuple(_read(f, "<Q") for _ in range(_read(f, "<I")))
            _read(f, "<I"), _read(f, "<Q")  # type, offset
    return metadata, shapes
