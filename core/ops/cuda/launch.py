"""Launching heron's kernels on torch CUDA tensors, zero-copy, on torch's current stream.

Ops call `launch` with tensors and explicitly typed scalars (`i32`, `i64`, `f32`); a tensor
argument becomes its device pointer (``None`` a null pointer). Kernels run on
``torch.cuda.current_stream()``, so they are ordered with torch's own ops and are recorded
by ``torch.cuda.graph`` capture (launch each shape once before capturing: the first launch
compiles and loads the module).

The backend is swappable (`use_backend`) so the tests can run the very same op code
against the CPU emulator in tests/gpu/emulator.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

import numpy as np
import torch

#: Where core's kernel sources live.
KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
#: Dynamic shared memory a kernel may use without setting its opt-in attribute.
DEFAULT_SMEM_LIMIT = 48 * 1024

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype: torch.dtype) -> int:
    """The HERON_DTYPE define for ``dtype`` (see kernels/common.cuh)."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"CUDA kernels support float32, float16 and bfloat16, not {dtype}") from None


def vec_elems(dtype: torch.dtype) -> int:
    """Elements in one 16-byte vector load (VEC in common.cuh)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def vec_rows(width: int, *tensors: torch.Tensor | None) -> bool:
    """Whether 16-byte vectors tile every row of ``tensors`` (``[rows, width]`` with
    contiguous rows, or ``[width]``; None is skipped): ``width`` a multiple of VEC, every base
    and row stride 16-byte aligned."""
    present = [t for t in tensors if t is not None]
    vec = vec_elems(present[0].dtype)
    return width % vec == 0 and all(
        t.data_ptr() % 16 == 0 and (t.dim() == 1 or t.stride(0) % vec == 0) for t in present)


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def packed_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (``[rows, ...]``) with every dim after the first packed, and the stride between
    its rows: a view when it already is (a column slice of a projection is), else a
    contiguous copy. A kernel then reads row ``r`` at ``r * stride``."""
    packed = t.shape[1:].numel()
    if t.dim() > 1 and t[0].is_contiguous() and t.stride(0) >= packed:
        return t, t.stride(0)
    return t.contiguous(), packed


class DeviceInfo(NamedTuple):
    num_sms: int
    max_smem_per_block: int  # with opt-in


class Backend(Protocol):
    def launch(self, file: str, name: str, defines: dict, grid: tuple[int, int, int],
               block: tuple[int, int, int], args: tuple, shared_mem: int,
               device: torch.device) -> None: ...

    def device_info(self, device: torch.device) -> DeviceInfo: ...


class _StreamRef:
    """A raw stream pointer dressed in the CUDA stream protocol, for cupy's from_external."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


class CupyBackend:
    """Compile through `heron.core.kernels.get_kernel`, launch with cupy on torch's stream."""

    def __init__(self) -> None:
        self._kernels: dict[tuple, Any] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._smem_opt_in: dict[tuple[int, int], int] = {}
        self._info: dict[int, DeviceInfo] = {}
        self._lock = threading.Lock()

    def launch(self, file, name, defines, grid, block, args, shared_mem, device):
        import cupy

        from heron.core.kernels import get_kernel

        index = device.index if device.index is not None else torch.cuda.current_device()
        packed = tuple(_pack(a) for a in args)
        key = (file, name, tuple(sorted(defines.items())), index)
        with cupy.cuda.Device(index):
            kernel = self._kernels.get(key)
            if kernel is None:  # the loader resolves paths and hashes sources: keep it off the hot path
                kernel = self._kernels[key] = get_kernel(KERNEL_DIR / file, name, defines)
            if shared_mem > DEFAULT_SMEM_LIMIT:
                self._opt_in(kernel, index, shared_mem)
            with self._stream(index):
                kernel(tuple(grid), tuple(block), packed, shared_mem=shared_mem)

    def device_info(self, device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        info = self._info.get(index)
        if info is None:
            props = torch.cuda.get_device_properties(index)
            smem = getattr(props, "shared_memory_per_block_optin", 0)
            if not smem:
                import cupy
                smem = cupy.cuda.Device(index).attributes.get("MaxSharedMemoryPerBlockOptin", 0)
            info = DeviceInfo(props.multi_processor_count, int(smem) or DEFAULT_SMEM_LIMIT)
            self._info[index] = info
        return info

    def _opt_in(self, kernel, index: int, nbytes: int) -> None:
        # NOTE: a function attribute, set per device before the kernel's first big launch.
        key = (id(kernel), index)
        if self._smem_opt_in.get(key, 0) < nbytes:
            kernel.max_dynamic_shared_size_bytes = nbytes
            self._smem_opt_in[key] = nbytes

    def _stream(self, index: int):
        ptr = torch.cuda.current_stream(index).cuda_stream
        stream = self._streams.get((index, ptr))
        if stream is None:
            import cupy
            try:
                stream = cupy.cuda.Stream.from_external(_StreamRef(ptr))
            except (AttributeError, TypeError):  # cupy < 14
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = cupy.cuda.ExternalStream(ptr, index)
            with self._lock:
                self._streams[(index, ptr)] = stream
        return stream


def _pack(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return np.uint64(a.data_ptr())
    if a is None:
        return np.uint64(0)
    if isinstance(a, np.generic):
        return a
    raise TypeError(f"kernel argument {a!r}: wrap Python scalars with i32 / i64 / f32")


_backend: Backend = CupyBackend()


def launch(file: str, name: str, defines: dict, grid: tuple[int, int, int],
           block: tuple[int, int, int], args: tuple, *, device: torch.device,
           shared_mem: int = 0) -> None:
    """Run kernel ``name`` of ``file`` built with ``defines``.

    ``file`` is a name in core's `KERNEL_DIR` or the absolute path of a plugin's ``.cu``.

    NOTE: every grid and block dimension must be >= 1; callers skip empty batches.
    """
    assert all(g >= 1 for g in grid) and all(b >= 1 for b in block), (name, grid, block)
    _backend.launch(file, name, defines, grid, block, args, shared_mem, device)


def device_info(device: torch.device) -> DeviceInfo:
    """SM count and opt-in shared memory per block of ``device``."""
    return _backend.device_info(device)


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Route launches to ``backend`` inside the block (the tests' CPU emulator)."""
    global _backend
    previous, _backend = _backend, backend
    try:
        yield
    finally:
        _backend = previous
