"""The CUDA kernel loader: ``.cu`` sources compiled once per (source, defines, arch) and cached.

Kernel sources are plain CUDA C files. Core registers ``core/ops/kernels/*.cu``; a plugin
registers its own with `register_kernel_file`. Kernels are ``extern "C"`` functions whose
dtype, head size and so on are chosen by ``#define``\\ s (``-DNAME=VALUE`` flags), which keeps
them simple for NVRTC; a C++ template kernel can be registered by its name expression
(``"my_kernel<128>"``) instead.

A ``#include "x.cuh"`` (quotes) is resolved against the including file's folder, then against
core's kernel folder (so a plugin's kernel may include ``"common.cuh"``), and inlined
with ``#line`` markers, so the compiled text is self-contained (cupy's disk cache keys on
the text, so an edited header can never serve a stale binary) and compiler messages still
name the original file and line. Angle-bracket includes are left to the compiler.

Run time (`get_kernel`) compiles with ``cupy.RawModule`` for the current device, using the
device's own NVRTC and include paths; cupy keeps the binaries on disk
(``~/.cupy/kernel_cache``) and this module keeps the loaded kernels in-process.
`heron.core.kernel_check` compiles every registered variant without a GPU, for CI and
``heron kernels --check``.

NOTE: nothing here imports cupy at module import time; importing heron never touches CUDA.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "KernelFile", "compile_options", "get_kernel", "load_source", "register_kernel_file",
    "registered_kernel_files",
]

#: Flags for every compile; defines come after them.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)

#: Core's kernel sources and headers, the fallback for quoted includes.
HEADER_DIR = Path(__file__).resolve().parent / "ops" / "kernels"

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


@dataclass
class KernelFile:
    """One registered source: the kernels it defines and the define sets it is built with.

    ``define_sets`` are the variants `kernel_check.check_kernels` compiles; at run time any define set
    may be requested through `get_kernel`.
    """

    path: Path
    kernel_names: list[str]
    define_sets: list[dict[str, Any]] = field(default_factory=list)


_REGISTRY: dict[Path, KernelFile] = {}
_LOCK = threading.Lock()
_KERNELS: dict[tuple, Any] = {}      # (source hash, defines, arch, name) -> RawKernel
_MODULES: dict[tuple, Any] = {}      # (source hash, defines, arch) -> RawModule
_SOURCES: dict[Path, tuple[str, str]] = {}  # path -> (expanded text, sha256)


def register_kernel_file(path: str | os.PathLike, kernel_names: Iterable[str],
                         defines: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
                         ) -> KernelFile:
    """Register ``path`` as defining ``kernel_names``, to be checked with ``defines``.

    ``defines`` is one define set, a list of them, or None (one variant, no defines).
    Registering the same file again merges names and define sets, so this may run once per
    process or once per worker without harm.
    """
    p = Path(path).resolve()
    if isinstance(defines, Mapping) or defines is None:
        sets = [dict(defines or {})]
    else:
        sets = [dict(d) for d in defines]
    with _LOCK:
        entry = _REGISTRY.setdefault(p, KernelFile(p, []))
        for name in kernel_names:
            if name not in entry.kernel_names:
                entry.kernel_names.append(name)
        for d in sets:
            if d not in entry.define_sets:
                entry.define_sets.append(d)
    return entry


def registered_kernel_files() -> list[KernelFile]:
    """Every registered kernel file, core's own included."""
    import heron.core.ops.cuda.sources  # noqa: F401  (registers core's kernels on import)
    with _LOCK:
        return list(_REGISTRY.values())


# ---------------------------------------------------------------------------- sources


def load_source(path: str | os.PathLike) -> str:
    """The text of ``path`` with its quoted includes inlined (recursively, each file once)."""
    return _expand(Path(path).resolve(), seen=set())


def _expand(path: Path, seen: set[Path]) -> str:
    if path in seen:  # an include guard by another name; #pragma once is not needed
        return ""
    seen.add(path)
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        if m is None:
            out.append(line)
            continue
        target = (path.parent / m.group(1)).resolve()
        if not target.is_file():
            target = HEADER_DIR / m.group(1)
        if not target.is_file():
            raise FileNotFoundError(f"{path}:{lineno}: included file {m.group(1)!r} not found")
        out.append(_expand(target, seen))
        out.append(f'#line {lineno + 1} "{path}"')
    return "\n".join(out) + "\n"


def _source(path: Path) -> tuple[str, str]:
    """(expanded text, sha256) of ``path``, read once per process."""
    with _LOCK:
        hit = _SOURCES.get(path)
    if hit is None:
        text = load_source(path)
        hit = (text, hashlib.sha256(text.encode()).hexdigest())
        with _LOCK:
            _SOURCES[path] = hit
    return hit


def _defines_key(defines: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (defines or {}).items()))


def compile_options(defines: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Compiler flags for a define set: `BASE_OPTIONS` then sorted ``-DNAME=VALUE``."""
    return BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in _defines_key(defines))


# ---------------------------------------------------------------------------- run time


def get_kernel(path: str | os.PathLike, name: str, defines: Mapping[str, Any] | None = None):
    """A ``cupy.RawKernel`` for ``name`` in ``path`` built with ``defines`` for the current device.

    Compiled on first use (NVRTC, ``-std=c++17``), then served from memory. The caller
    launches it on the stream it wants (see ``heron.core.ops.cuda.launch``). ``name`` may be
    a C++ name expression such as ``"kernel<128>"``.
    """
    import cupy

    p = Path(path).resolve()
    text, digest = _source(p)
    dkey = _defines_key(defines)
    arch = f"sm_{cupy.cuda.Device().compute_capability}"  # e.g. "sm_90"
    key = (digest, dkey, arch, name)
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    with _LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            mkey = (digest, dkey, arch)
            module = _MODULES.get(mkey)
            if module is None:
                names = _registered_name_expressions(p)
                module = cupy.RawModule(code=text, options=compile_options(defines),
                                        name_expressions=names or None)
                _MODULES[mkey] = module
            try:
                kernel = module.get_function(name)
            except Exception as exc:  # compile errors surface here; name the file and defines
                raise RuntimeError(f"compiling {p} with {dict(dkey)} for {arch} failed:\n{exc}") from exc
            _KERNELS[key] = kernel
    return kernel


def _registered_name_expressions(path: Path) -> list[str]:
    entry = _REGISTRY.get(path)
    return [n for n in (entry.kernel_names if entry else []) if "<" in n]
