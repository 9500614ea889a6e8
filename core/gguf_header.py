"""Reads single metadata values from a GGUF header without parsing the whole file.

`gguf.GGUFReader` parses every field (a 49k-token vocabulary takes seconds); picking a
model family only needs ``general.architecture``, usually the first key.
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


def read_gguf_value(path: str | Path, key: str) -> Any:
    """The value of metadata ``key``, or KeyError. Stops reading at the key."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file")
        _read(f, "<I")  # version
        _read(f, "<Q")  # tensor count
        for _ in range(_read(f, "<Q")):
            name = f.read(_read(f, "<Q")).decode("utf-8", errors="replace")
            value = _value(f, _read(f, "<I"))
            if name == key:
                return value
    raise KeyError(f"GGUF file {str(path)!r} has no metadata key {key!r}")
