"""The CUDA kernel loader: ``.cu`` sources compiled once per (source, defines, arch) and cached.

Kernel sources are plain CUDA C files. Core registers ``core/ops/kernels/*.cu``; a plugin
registers its own with `register_kernel_file`. Kernels are ``extern "C"`` functions whose
dtype, head size and so on are chosen by ``#define``\\ s (``-DNAME=VALUE`` flags), which keeps
them simple for NVRTC; a C++ template kernel can be registered by its name expression
(``"my_kernel<128>"``) instead.

A ``#include "x.cuh"`` (quotes) is resolved against the including file's folder and inlined
with ``#line`` markers, so the compiled text is self-contained (cupy's disk cache keys on
the text, so an edited header can never serve a stale binary) and compiler messages still
name the original file and line. Angle-bracket includes are left to the compiler.

Run time (`get_kernel`) compiles with ``cupy.RawModule`` for the current device, using the
device's own NVRTC and include paths; cupy keeps the binaries on disk
(``~/.cupy/kernel_cache``) and this module keeps the loaded kernels in-process.
`check_kernels` compiles every registered variant without a GPU (low-level NVRTC, else
``nvcc``), for CI and ``heron kernels --check``.

NOTE: nothing here imports cupy at module import time; importing heron never touches CUDA.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

__all__ = [
    "CheckResult", "KernelFile", "check_kernels", "compile_options", "format_check",
    "get_kernel", "load_source", "register_kernel_file", "registered_kernel_files", "run_check",
]

#: Flags for every compile; defines come after them.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


@dataclass
class KernelFile:
    """One registered source: the kernels it defines and the define sets it is built with.

    ``define_sets`` are the variants `check_kernels` compiles; at run time any define set
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


# ---------------------------------------------------------------------------- checks


class CheckResult(NamedTuple):
    """One line of a compile check: every variant of ``file`` built for ``arch``, or why not."""

    file: str
    arch: str
    ok: bool
    message: str


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:  # cupy missing, or its NVRTC library missing
        return None


def _cuda_include_dirs() -> list[str]:
    """CUDA runtime headers for check-time compiles (kernels may include <cuda_fp16.h>)."""
    dirs = []
    try:
        import nvidia.cuda_runtime as rt
        for base in rt.__path__:
            if (Path(base) / "include").is_dir():
                dirs.append(str(Path(base) / "include"))
    except ImportError:
        pass
    for base in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda_runtime.h").is_file():
            dirs.append(str(Path(base) / "include"))
            break
    return dirs


def compiler_available() -> str | None:
    """``"nvrtc"`` or ``"nvcc"`` (what `check_kernels` will use), or None."""
    if _nvrtc() is not None:
        return "nvrtc"
    return "nvcc" if shutil.which("nvcc") else None


def compile_cubin(text: str, filename: str, arch: str, options: tuple[str, ...],
                  names: Iterable[str] = ()) -> tuple[bool, str]:
    """Compile ``text`` for ``arch`` without a GPU; (ok, compiler log or error).

    On success also checks that every ``extern "C"`` name in ``names`` is in the binary,
    so a registered kernel name that the source does not define is caught.
    """
    nvrtc = _nvrtc()
    if nvrtc is not None:
        ok, log, cubin = _compile_nvrtc(nvrtc, text, filename, arch, options, names)
    elif shutil.which("nvcc"):
        ok, log, cubin = _compile_nvcc(text, filename, arch, options)
    else:
        return False, "no CUDA compiler: install cupy-cuda12x and nvidia-cuda-nvrtc-cu12, or put nvcc on PATH"
    if ok:
        missing = [n for n in names if "<" not in n and f"{n}\0".encode() not in cubin]
        if missing:
            return False, f"kernel(s) {missing} not defined in {filename}"
    return ok, log


def _compile_nvrtc(nvrtc, text, filename, arch, options, names):
    opts = (f"--gpu-architecture={arch}", *options, *(f"-I{d}" for d in _cuda_include_dirs()))
    prog = nvrtc.createProgram(text, filename, [], [])
    try:
        for n in names:
            if "<" in n:
                nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            return False, nvrtc.getProgramLog(prog), b""
        return True, nvrtc.getProgramLog(prog), bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def _compile_nvcc(text, filename, arch, options):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(text)  # the #line markers keep the original file name in messages
        cmd = ["nvcc", f"-arch={arch}", "-cubin", *options,
               *(f"-I{d}" for d in _cuda_include_dirs()), "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = (proc.stdout + proc.stderr).strip()
        return proc.returncode == 0, log, out.read_bytes() if out.exists() else b""


def check_kernels(archs: Iterable[str] = ("sm_80", "sm_90"),
                  files: Iterable[KernelFile] | None = None) -> list[CheckResult]:
    """Compile every variant of every registered kernel file for each arch, without a GPU.

    One result per (file, arch), in registration order: ok when all its define sets
    compiled, else the first failure's log. Variants compile in parallel threads (NVRTC
    releases the GIL). When no compiler is available each result says so (ok False).
    """
    archs = tuple(archs)
    entries = list(registered_kernel_files() if files is None else files)
    jobs, texts = [], {}
    for entry in entries:
        try:
            texts[entry.path] = load_source(entry.path)
        except OSError as exc:  # a missing file or include
            texts[entry.path] = exc
        for arch in archs:
            for defines in entry.define_sets or [{}]:
                jobs.append((entry, arch, defines))

    def run(job):
        entry, arch, defines = job
        text = texts[entry.path]
        if isinstance(text, Exception):
            return False, str(text), 0.0
        t0 = time.perf_counter()
        ok, log = compile_cubin(text, str(entry.path), arch, compile_options(defines),
                                entry.kernel_names)
        return ok, (log if ok else f"defines {defines}:\n{log.strip()}"), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        outcomes = dict(zip(map(id, jobs), pool.map(run, jobs)))
    results = []
    for entry in entries:
        for arch in archs:
            mine = [outcomes[id(j)] for j in jobs if j[0] is entry and j[1] == arch]
            failure = next((msg for ok, msg, _ in mine if not ok), None)
            message = failure or f"{len(mine)} variant(s), {sum(t for _, _, t in mine):.2f} s"
            results.append(CheckResult(str(entry.path), arch, failure is None, message))
    return results


def format_check(results: Iterable[CheckResult]) -> str:
    """One line per file and arch (``ok``/``FAIL``), a failure's log indented below it."""
    lines = []
    for r in results:
        head = r.message.splitlines()[0] if r.ok else "compile error"
        lines.append(f"{'ok  ' if r.ok else 'FAIL'} {r.arch:<7} {_short(r.file)}  {head}")
        if not r.ok:
            lines.extend("    " + ln for ln in r.message.splitlines())
    return "\n".join(lines)


def _short(path: str) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def run_check(archs: Iterable[str] = ("sm_80", "sm_90"), out=None) -> int:
    """``heron kernels --check``: print `format_check` and return an exit code (0 all ok)."""
    out = out or sys.stdout
    which = compiler_available()
    if which is None:
        print("no CUDA compiler found (need cupy + NVRTC, or nvcc on PATH); nothing checked",
              file=out)
        return 2
    results = check_kernels(tuple(archs))
    print(f"compiler: {which}", file=out)
    print(format_check(results), file=out)
    return 0 if all(r.ok for r in results) else 1
