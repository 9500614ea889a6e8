"""Compile checks without a GPU: every registered kernel variant, for CI and
``heron kernels --check``.

Uses low-level NVRTC (cupy's bindings plus the CUDA runtime headers) when importable, else
``nvcc``; a syntax error comes back with its file and line. A success is remembered (an
empty file in ``cuda-check`` under `heron.core.cpu_kernels.cache_dir`, named by a hash of
everything the compile read), so checking unchanged kernels again costs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, NamedTuple

from heron.core.cpu_kernels import cache_dir
from heron.core.kernels import (KernelFile, compile_options, load_source,
                                registered_kernel_files)
from heron.core.plugins import PluginManager

__all__ = ["CheckResult", "check_kernels", "compiler_available", "format_check", "run_check"]

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
    so a registered kernel name that the source does not define is caught, and remembers
    the success (`_passed`): the same inputs to the same compiler pass again without
    compiling (``heron kernels --check`` then the suite's compile test, say).
    """
    names = tuple(names)
    nvrtc = _nvrtc()
    compiler = "nvrtc" if nvrtc is not None else "nvcc" if shutil.which("nvcc") else None
    if compiler is None:
        return False, "no CUDA compiler: install cupy-cuda12x and nvidia-cuda-nvrtc-cu12, or put nvcc on PATH"
    stamp = _passed(compiler, text, filename, arch, options, names)
    if stamp.is_file():
        return True, "unchanged since it last compiled"
    if nvrtc is not None:
        ok, log, cubin = _compile_nvrtc(nvrtc, text, filename, arch, options, names)
    else:
        ok, log, cubin = _compile_nvcc(text, filename, arch, options)
    if ok:
        missing = [n for n in names if "<" not in n and f"{n}\0".encode() not in cubin]
        if missing:
            return False, f"kernel(s) {missing} not defined in {filename}"
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    return ok, log


def _passed(compiler: str, *inputs) -> Path:
    """The file whose presence says these inputs compiled: named by a hash of them, of the
    compiler's version and of the CUDA headers' directories (a reinstall changes them)."""
    headers = [f"{d}:{os.stat(d).st_mtime_ns}" for d in _cuda_include_dirs()]
    key = repr((_compiler_version(compiler), headers, inputs)).encode()
    return cache_dir() / "cuda-check" / hashlib.sha256(key).hexdigest()


@functools.cache
def _compiler_version(compiler: str) -> str:
    if compiler == "nvrtc":
        return f"nvrtc {_nvrtc().getVersion()}"
    return subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout


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
    """Compile every variant of every kernel file (core's and the plugins') for each arch,
    without a GPU.

    One result per (file, arch), in registration order: ok when all its define sets
    compiled, else the first failure's log. Variants compile in parallel threads (NVRTC
    releases the GIL). When no compiler is available each result says so (ok False).
    """
    archs = tuple(archs)
    if files is None:
        PluginManager()  # plugins register their kernel files as they load
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
