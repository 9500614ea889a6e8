"""Replay of recorded decode steps on the CPU: CUDA graphs' idea, for Python's cost per op.

A small model's decode step on the CPU is hundreds of short ops (SmolLM2-135M: nine a
layer, thirty layers), and calling each from Python (its checks, a tensor for its output, a
ctypes call) took about as long as the arithmetic. So a decode step is recorded once per
graph key, on the static inputs `heron.core.cuda_graphs.StaticDecodeInputs` keeps (padded
batch size; the context bound only where attention is not the compiled kernel, whose work
the lengths it reads decide), by running the family's forward eagerly: each compiled kernel
it calls (`heron.core.cpu_kernels.Kernel`) is kept with its argument words, each torch op
with its arguments and results, and every tensor made during the step lives as long as the
record. A replay copies the step's inputs in and runs the record: each run of kernels by one
C call (``kernels/replay_cpu.cpp``), each torch op into the tensors it first wrote.

The family's forward must be graph-safe as `heron.core.cuda_graphs` says, and more: no host
code reads a tensor's values, and a kernel's pointers are to tensors made during the step or
to tensors that outlive the records (weights, caches, the static inputs). A recording that
meets what a replay could not repeat (a value read through torch, random numbers, a shape
that depends on values, a kernel with no packed entry point) is dropped: its step's logits
stand, and that key's steps run eagerly. LoRA steps always run eagerly (the adapters'
scales are read on the host).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from itertools import groupby
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heron.core import cpu_kernels
from heron.core.batch import Batch
from heron.core.cuda_graphs import StaticDecodeInputs

log = logging.getLogger(__name__)

aten = torch.ops.aten
# ops that make a tensor and compute nothing: a replay has the tensor already
_ALLOCATIONS = frozenset((aten.empty.memory_format, aten.empty_like.default,
                          aten.empty_strided.default, aten.new_empty.default,
                          aten.new_empty_strided.default))
# ops whose result a replay could not repeat
_UNREPEATABLE = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape,
                 torch.Tag.nondeterministic_seeded)


def _word(arg) -> int:
    """A kernel argument as `packed_cpu.h`'s 64-bit word."""
    if arg is None:
        return 0
    if isinstance(arg, float):
        return struct.unpack("<q", struct.pack("<d", arg))[0]
    return int(arg)


def _repeatable(func, args, kwargs) -> bool:
    if func is aten.scaled_dot_product_attention.default:  # random only by its dropout
        return kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) == 0.0
    # an op that hands the host a value (``bool(t)`` dispatches is_nonzero, which no tag
    # marks): the forward's Python went its way on this step's data, and a replay would go
    # the same way whatever its own
    return (not any(tag in func.tags for tag in _UNREPEATABLE)
            and all("Tensor" in str(r.type) for r in func._schema.returns))


def _aliases(out, base) -> bool:
    """Whether a view op's result shares its input's memory: ``reshape`` and ``contiguous``
    are views that copy where the layout asks for it, and a copy must be repeated."""
    return all(t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
               for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class _Recorder(TorchDispatchMode):
    """Sees every torch op and compiled kernel of one forward; `calls` is what a replay
    runs, in order; `refusal` says why the step cannot be replayed, None if it can."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_KernelCall | _TorchCall] = []
        self.made: list = []  # what the ops returned: alive as long as the record
        self.refusal: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.made.append(out)
        if func in _ALLOCATIONS:
            return out
        if func.is_view:
            try:
                if _aliases(out, args[0]):
                    return out
            except RuntimeError:  # no storage to compare (an opaque oneDNN tensor)
                self.refusal = self.refusal or f"torch op {func} of an opaque tensor"
                return out
        if not _repeatable(func, args, kwargs):
            self.refusal = self.refusal or f"torch op {func}"
        else:
            self.calls.append(_TorchCall(func, args, kwargs,
                                         None if func._schema.is_mutable else out))
        return out

    def kernel(self, kernel: cpu_kernels.Kernel, args: tuple) -> None:
        if kernel.packed is None:
            self.refusal = self.refusal or f"kernel {kernel.function.__name__} (not packed)"
            return
        self.calls.append(_KernelCall(ctypes.cast(kernel.packed, ctypes.c_void_p).value,
                                      [_word(a) for a in args]))


class _KernelCall:
    __slots__ = ("address", "words")

    def __init__(self, address: int, words: list[int]) -> None:
        self.address, self.words = address, words


class _TorchCall:
    """A torch op as recorded; a call repeats it, a pure op's results copied into the
    tensors of the recording (``out``)."""

    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs, out) -> None:
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def __call__(self) -> bool:
        result = self.func(*self.args, **self.kwargs)
        if self.out is not None:
            for dst, src in zip(tree_leaves(self.out), tree_leaves(result)):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
        return True


class _KernelRun:
    """Consecutive kernel calls, replayed by one C call."""

    def __init__(self, calls: list[_KernelCall]) -> None:
        self.replay = _replay_kernel()
        self.words = [(ctypes.c_int64 * len(c.words))(*c.words) for c in calls]
        self.kernels = (ctypes.c_void_p * len(calls))(*(c.address for c in calls))
        self.pointers = (ctypes.c_void_p * len(calls))(*map(ctypes.addressof, self.words))
        self.count = len(calls)

    def __call__(self) -> bool:
        return self.replay(self.kernels, self.pointers, self.count) == 0


class CpuGraph:
    """One recorded decode step: `replay` reruns it on the static inputs' current values;
    ``output`` (the logits) holds the result until the next replay."""

    def __init__(self, recorder: _Recorder, output: torch.Tensor) -> None:
        self.made, self.output = recorder.made, output
        self.runs: list[Callable[[], bool]] = []
        for is_kernel, calls in groupby(recorder.calls, lambda c: isinstance(c, _KernelCall)):
            self.runs += [_KernelRun(list(calls))] if is_kernel else calls

    @torch.inference_mode()
    def replay(self) -> bool:
        """False where a kernel reported a failure (the step is then to run eagerly)."""
        return all(run() for run in self.runs)


def record(forward: Callable[[Batch], torch.Tensor],
           batch: Batch) -> tuple[torch.Tensor, CpuGraph | None]:
    """Run ``forward(batch)`` once: its logits, and the record of it (None where a replay
    could not repeat it; the reason is logged)."""
    recorder = _Recorder()
    with recorder, cpu_kernels.recording(recorder):
        logits = forward(batch)
    if recorder.refusal is not None or _replay_kernel() is None:
        log.info("decode step not recorded (%s): it runs eagerly",
                 recorder.refusal or "no replay kernel built")
        return logits, None
    return logits, CpuGraph(recorder, logits)


@functools.cache
def _replay_kernel():
    lib = cpu_kernels.load("replay_cpu.cpp")
    if lib is None:
        return None
    lib.heron_replay.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.heron_replay.restype = ctypes.c_int64
    return lib.heron_replay.function


class CpuDecodeGraphs:
    """Runs decode batches of up to ``max_num_seqs`` sequences by replaying recorded steps;
    the interface of `heron.core.cuda_graphs.DecodeGraphs`. Logits returned by `run` are
    valid until the next `run`. ``cpu_kernels``: attention by the compiled kernels (see
    `heron.core.batch.AttentionMetadata`), whose work does not depend on the context bound:
    then one record serves each batch size (each record keeps its own tensors)."""

    def __init__(self, forward: Callable[[Batch], torch.Tensor], *, max_num_seqs: int,
                 max_context_len: int, block_size: int, cpu_kernels: bool) -> None:
        self.forward = forward
        self.inputs = StaticDecodeInputs(max_num_seqs=max_num_seqs,
                                         max_context_len=max_context_len,
                                         block_size=block_size, device=torch.device("cpu"),
                                         cpu_kernels=cpu_kernels)
        self.graphs: dict[tuple[int, int, bool], CpuGraph | None] = {}
        self.replays = 0

    def can_run(self, batch: Batch) -> bool:
        return batch.lora_slots is None and self.inputs.fits(batch)

    def run(self, batch: Batch) -> torch.Tensor:
        size, bound, with_lora = self.inputs.load(batch)
        if self.inputs.cpu_kernels:  # the compiled attention reads the lengths themselves
            bound = self.inputs.max_context_len
        key = size, bound, with_lora
        num = batch.attn.num_seqs
        if key not in self.graphs:
            logits, self.graphs[key] = record(self.forward, self.inputs.batch(*key))
            return logits[:num]
        graph = self.graphs[key]
        if graph is not None:
            try:
                if graph.replay():
                    self.replays += 1
                    return graph.output[:num]
            except Exception:  # the step itself can still run: no longer this way
                log.exception("replay of a recorded decode step failed: it runs eagerly")
                self.graphs[key] = None
        return self.forward(batch)
