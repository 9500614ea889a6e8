"""Run heron's CUDA kernels on the CPU: a test backend for `heron.core.ops.cuda.launch`.

Each kernel source is compiled with g++ against ``cuda_shim.h`` (threads for CUDA threads,
real barriers for ``__syncthreads`` and shuffles) plus a generated ``emu_<kernel>`` wrapper
per ``extern "C"`` kernel, and launched through ctypes on CPU tensors. The wrappers' C
signatures are parsed from the source, so the argument list an op passes is checked against
the kernel's parameters (count, and pointer / int / long long / float for each).

It checks indexing, masking, synchronisation and the Python launch plumbing. The
tensor-core instructions kernels reach through kernels/mma.cuh (mma.sync m16n8k16, ldmatrix,
cp.async) are emulated warp-collectively from the PTX ISA fragment layouts, with alignment
and shared-memory range checks on their addresses, and cp.async lands only at its wait.
Not checked: the PTX itself (the compile check does that), other alignment faults, cupy,
real timing (the GPU tests do).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from heron.core.kernels import load_source
from heron.core.ops.cuda.launch import KERNEL_DIR, DeviceInfo

SHIM = Path(__file__).with_name("cuda_shim.h")
_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)\s*\{',
    re.S)


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def _params(text: str) -> list[tuple[str, str, str]]:
    """[(ctype kind, C declaration, name)] of one kernel's parameter list."""
    out = []
    for decl in (p.strip() for p in text.split(",")):
        name = re.findall(r"\w+", decl)[-1]
        if "*" in decl:
            kind = "ptr"
        elif re.search(r"\blong\s+long\b", decl):
            kind = "i64"
        elif re.search(r"\bint\b", decl):
            kind = "i32"
        elif re.search(r"\bfloat\b", decl):
            kind = "f32"
        else:
            raise TypeError(f"emulator: unsupported kernel parameter {decl!r}")
        out.append((kind, decl, name))
    return out


_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_longlong, "i32": ctypes.c_int,
           "f32": ctypes.c_float}
_NUMPY = {"i64": np.int64, "i32": np.int32, "f32": np.float32}


class EmulatorBackend:
    """`launch.Backend` running kernels on CPU threads; ``device_info`` is configurable."""

    def __init__(self, num_sms: int = 8, max_smem_per_block: int = 227 * 1024,
                 cache_dir: Path | None = None):
        self.info = DeviceInfo(num_sms, max_smem_per_block)
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "heron-kernel-emulator")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._libs: dict[tuple, tuple[ctypes.CDLL, dict]] = {}
        self.launches: list[tuple[str, tuple, tuple, int]] = []  # (name, grid, block, smem)

    def device_info(self, device):
        return self.info

    def launch(self, file, name, defines, grid, block, args, shared_mem, device):
        lib, signatures = self._library(KERNEL_DIR / file, defines)
        params = signatures[name]
        if len(args) != len(params):
            raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        cargs = []
        for a, (kind, decl, _) in zip(args, params):
            if kind == "ptr":
                if a is not None and not isinstance(a, torch.Tensor):
                    raise TypeError(f"{name}: {decl!r} needs a tensor, got {a!r}")
                if a is not None and a.device.type != "cpu":
                    raise TypeError(f"{name}: the emulator runs on CPU tensors")
                cargs.append(ctypes.c_void_p(a.data_ptr() if a is not None else None))
            else:
                if type(a) is not _NUMPY[kind]:
                    raise TypeError(f"{name}: {decl!r} needs {_NUMPY[kind].__name__}, got {a!r}")
                cargs.append(_CTYPES[kind](a.item()))
        self.launches.append((name, tuple(grid), tuple(block), shared_mem))
        getattr(lib, f"emu_{name}")(*grid, *block, ctypes.c_ulonglong(shared_mem), *cargs)

    def _library(self, path: Path, defines: dict):
        key = (str(path), tuple(sorted((k, str(v)) for k, v in defines.items())))
        if key in self._libs:
            return self._libs[key]
        source = load_source(path)
        signatures, wrappers = {}, []
        for name, plist in _KERNEL_RE.findall(re.sub(r"//[^\n]*", "", source)):
            params = _params(plist)
            signatures[name] = params
            decls = ", ".join(d for _, d, _ in params)
            names = ", ".join(n for _, _, n in params)
            wrappers.append(
                f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                f"unsigned by, unsigned bz, unsigned long long smem, {decls}) {{\n"
                f"  heron_emu::launch(dim3(gx, gy, gz), dim3(bx, by, bz), smem, [=] {{ {name}({names}); }});\n}}")
        text = source + "\n" + "\n".join(wrappers) + "\n"
        flags = [f"-D{k}={v}" for k, v in key[1]]
        digest = hashlib.sha256((text + SHIM.read_text() + " ".join(flags)).encode()).hexdigest()[:20]
        lib_path = self.cache_dir / f"{path.stem}-{digest}.so"
        if not lib_path.exists():
            src = self.cache_dir / f"{path.stem}-{digest}.cpp"
            src.write_text(text)
            cmd = ["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w",
                   "-include", str(SHIM), *flags, "-o", str(lib_path) + ".tmp", str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"emulator build of {path.name} {dict(key[1])} failed:\n{proc.stderr[-4000:]}")
            Path(str(lib_path) + ".tmp").rename(lib_path)
        lib = ctypes.CDLL(str(lib_path))
        for name, params in signatures.items():
            fn = getattr(lib, f"emu_{name}")
            fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_ulonglong] + [_CTYPES[k] for k, _, _ in params]
            fn.restype = None
        self._libs[key] = (lib, signatures)
        return self._libs[key]
