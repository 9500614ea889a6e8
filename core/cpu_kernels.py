"""The CPU kernel loader: C++ sources built once per (source, defines, compiler, CPU) with the
system's C++ compiler, cached on disk and loaded through ctypes.

A CPU kernel is an ``extern "C"`` function over raw pointers in ``core/ops/kernels/*_cpu.cpp``,
configured by ``-DNAME=VALUE`` defines like the CUDA kernels; what the sources share is in
headers beside them (``*.h``). It is built for the machine it runs on (``-march=native``),
with OpenMP where the compiler has it. The torch ops stay the
reference and the fallback: `load` returns None where there is no compiler or a build fails
(logged once per source and defines), and the caller goes on with torch.

Builds land in ``$HERON_KERNEL_CACHE`` (default ``~/.cache/heron/cpu-kernels``), named by a
hash of everything that goes into them (the headers beside the source included), written to a temporary name and renamed, so
processes building the same library at once never load half a file.

`load` gives the library's functions as `Kernel`s: ctypes functions (``argtypes`` and
``restype`` set on them as usual) that a decode step being recorded (`heron.core.cpu_graphs`)
sees called. A kernel's source declares a packed entry point for each function
(`kernels/packed_cpu.h`) so that a recorded step can replay it from C.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "ops" / "kernels"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wall")

_LOCK = threading.Lock()
_LIBRARIES: dict[tuple, Library | None] = {}


def _of_function(name: str) -> property:
    """The wrapped ctypes function's attribute ``name``, read and set through the wrapper."""
    return property(lambda self: getattr(self.function, name),
                    lambda self, value: setattr(self.function, name, value))


class Kernel:
    """One function of a built library, called as the ctypes function it wraps; while this
    thread records (`recording`), each call is shown to the recorder before it runs.
    ``packed``: the function's packed entry point, None where the source declares none."""

    __slots__ = ("function", "packed")
    argtypes = _of_function("argtypes")
    restype = _of_function("restype")

    def __init__(self, function: ctypes._CFuncPtr, packed: ctypes._CFuncPtr | None) -> None:
        self.function, self.packed = function, packed

    def __call__(self, *args):
        recorder = _RECORDING.recorder
        if recorder is not None:
            recorder.kernel(self, args)
        return self.function(*args)


class Library:
    """A built library: its functions, by name, as `Kernel`s."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll

    def __getattr__(self, name: str) -> Kernel:
        kernel = Kernel(getattr(self.cdll, name), getattr(self.cdll, name + "_packed", None))
        setattr(self, name, kernel)  # later lookups find the attribute, not this method
        return kernel


class _Recording(threading.local):
    recorder = None


_RECORDING = _Recording()


@contextlib.contextmanager
def recording(recorder):
    """Show this thread's kernel calls to ``recorder.kernel(kernel, args)`` (before each
    runs) while the block runs."""
    previous, _RECORDING.recorder = _RECORDING.recorder, recorder
    try:
        yield recorder
    finally:
        _RECORDING.recorder = previous


def cache_dir() -> Path:
    """``$HERON_KERNEL_CACHE`` if set, else ``~/.cache/heron/cpu-kernels``."""
    env = os.environ.get("HERON_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "heron" / "cpu-kernels"


def compiler() -> list[str] | None:
    """``$CXX`` if set (split as a shell would: ``ccache g++``), else the first of c++, g++,
    clang++ on the PATH."""
    env = os.environ.get("CXX")
    if env:
        return shlex.split(env)
    return next(([c] for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def load(source: str, defines: Mapping[str, Any] | None = None,
         vec_floats: int | None = None) -> Library | None:
    """The library built from ``KERNEL_DIR / source`` with ``defines``; None where it
    cannot be built. Builds at most once per process (a failure is remembered too).
    ``vec_floats`` (8, 16): vectors of that many floats (`vec_cpu.h`'s ``VEC_FLOATS``)
    rather than the machine's register width."""
    defines = {**(defines or {}), **({"VEC_FLOATS": vec_floats} if vec_floats else {})}
    key = (source, tuple(sorted((str(k), str(v)) for k, v in defines.items())))
    with _LOCK:  # one build at a time; a second caller waits for the first's result
        if key not in _LIBRARIES:
            _LIBRARIES[key] = _build(KERNEL_DIR / source, key[1])
        return _LIBRARIES[key]


def _build(path: Path, defines: tuple[tuple[str, str], ...]) -> Library | None:
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found (set CXX): %s not built, torch ops instead",
                    path.name)
        return None
    flags = FLAGS + tuple(f"-D{k}={v}" for k, v in defines)
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        # the headers beside the source (which it may include) go into the name too
        headers = [h.read_text() for h in sorted(path.parent.glob("*.h"))]
        digest = hashlib.sha256("\0".join(
            (path.read_text(), *headers, *cxx, version, _cpu_id(), *flags)
        ).encode()).hexdigest()[:24]
        target = cache_dir() / f"{path.stem}-{digest}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _compile(cxx, path, flags, target)
        return Library(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("%s not built (%s), torch ops instead", path.name, e)
        return None


def _compile(cxx: list[str], path: Path, flags: tuple[str, ...], target: Path) -> None:
    """Build ``target``, with OpenMP if the compiler has it, else without."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (("-fopenmp",), ()):
            done = subprocess.run([*cxx, *flags, *extra, str(path), "-o", tmp],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(tmp, target)
                return
        raise subprocess.SubprocessError(done.stderr.strip()[-2000:])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(l for l in lines if l.split(":")[0].strip() in wanted))
