"""Projection weights kept in a GGUF file's quantized blocks on the CPU: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, the K-quants Q3_K, Q4_K, Q5_K, Q6_K (those of Q3_K_M to Q5_K_M files, which
fall back to Q4_0, Q5_0, Q5_1 and Q8_0 where rows are not whole 256-value blocks), IQ4_NL
and IQ4_XS.

A decode step reads every weight once, and on the CPU that read sets its speed: a Q4_1
weight is 0.625 bytes a value, float32's 4. `QuantizedWeight` holds the blocks as they lie in
the file and `quantized_linear` multiplies float32 rows with them through a compiled kernel
(``kernels/quant_linear_cpu.cpp``) that dequantizes a few weight rows at a time into float32,
exactly gguf's values, so a result differs from the float32 matmul of the dequantized weight
only in the order of its sums.

With ``int8_activations`` a batch of a few rows (a decode step; `QuantType.int8_rows`) is
quantized as the weights are, each block of 32 values to int8 with a float32 scale, and
the kernel multiplies the blocks in integers (``heron_quant_linear_int8``): several times
faster, but x is rounded to 8 bits a value (about 0.5% relative error a product).

A `QuantizedWeight` stands in for a ``[out, in]`` float32 weight where the model's code
moves, fuses and multiplies weights: ``to`` another device or dtype and `unpack_weight`
give the dequantized tensor, `cat` fuses row blocks (q/k/v, gate/up), into a
`QuantizedStack` where their types differ.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple

import numpy as np
import torch

from heron.core import cpu_kernels

#: From this many rows on, `quantized_linear` dequantizes the weight and multiplies it with
#: torch's float32 GEMM, which blocks x for the caches as the kernel's tiles do not: at 64
#: rows of SmolLM2's projections the tiles took 1.2-1.4x its time, at 1024 1.4x (the
#: dequantization costs about 2% of it there).
DEQUANTIZED_ROWS = 64


class QuantType(NamedTuple):
    name: str
    values: int  # a block's
    bytes: int  # a block's
    #: Up to this many rows, a weight with ``int8_activations`` multiplies in integers.
    #: SmolLM2's 1536 x 576 Q4_1 projection took 54 us against the float32 kernel's 84 at 1
    #: row, 105 against 177 at 4, 382 against 437 at 16, and about as long from 32 rows on
    #: (2 AVX2 cores). A K-quant unpacks each sub-block's 6-bit scales again for every 4 rows,
    #: Q5_0 and Q5_1 their fifth bits: a 2048 x 2048 Q4_K weight took about 200 us against 290
    #: at 1 row, 430 against 640 at 4, as long at 8 and 1.3x longer at 16; Q5_0 300 against
    #: 450, 550 against 830, 2000 against 1700 at 16.
    int8_rows: int


# by ggml type number
QUANT_TYPES = {2: QuantType("Q4_0", 32, 18, 16), 3: QuantType("Q4_1", 32, 20, 16),
               6: QuantType("Q5_0", 32, 22, 4), 7: QuantType("Q5_1", 32, 24, 4),
               8: QuantType("Q8_0", 32, 34, 16), 11: QuantType("Q3_K", 256, 110, 4),
               12: QuantType("Q4_K", 256, 144, 4), 13: QuantType("Q5_K", 256, 176, 4),
               14: QuantType("Q6_K", 256, 210, 4), 20: QuantType("IQ4_NL", 32, 18, 16),
               23: QuantType("IQ4_XS", 256, 136, 4)}


class KeptWeight:
    """What a `QuantizedWeight` and a `QuantizedStack` share: a float32 CPU ``[out, in]``
    weight's stand-in, whose values ``dequantize`` gives."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what it multiplies with and stands for

    @property
    def is_cuda(self) -> bool:
        return False

    def to(self, device=None, dtype=None) -> KeptWeight | torch.Tensor:
        """Itself on the CPU as float32; anywhere else, the dequantized tensor there."""
        if torch.device(device or "cpu").type == "cpu" and dtype in (None, torch.float32):
            return self
        return self.dequantize().to(device=device, dtype=dtype)

    def contiguous(self) -> KeptWeight:
        return self


@dataclass(eq=False)
class QuantizedWeight(KeptWeight):
    """A ``[out, in]`` weight as ``blocks``: uint8 ``[out, in / values * bytes]`` (a block's,
    `QuantType`), each row its values' blocks of ggml type ``qtype`` in order;
    ``int8_activations``: small batches multiply it with their values rounded to int8 (see
    above)."""

    blocks: torch.Tensor
    qtype: int
    in_features: int
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"ggml type {self.qtype} is not a kept quantization type")
        t = QUANT_TYPES[self.qtype]
        if (self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2
                or self.in_features % t.values
                or self.blocks.shape[1] != self.in_features // t.values * t.bytes):
            raise ValueError(f"{t.name} blocks of shape {tuple(self.blocks.shape)} do not hold "
                             f"rows of {self.in_features} values")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 ``[out, in]`` weight, gguf's values (by the kernel where it builds),
        written into ``out`` if given (float32, at least as many elements)."""
        lib = _kernel(self.qtype)
        if lib is None:
            import gguf  # only where a weight was kept quantized, i.e. read from a GGUF file
            rows = gguf.quants.dequantize(self.blocks.numpy(),
                                          gguf.GGMLQuantizationType(self.qtype))
            return torch.from_numpy(np.ascontiguousarray(rows.reshape(self.shape)))
        out = torch.empty(self.shape) if out is None else out[:self.shape.numel()].view(self.shape)
        lib.heron_dequantize(self.blocks.data_ptr(), out.data_ptr(), *self.shape)
        return out

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> KeptWeight | None:
        """The weights' rows one after another: a `QuantizedWeight` where all share a type,
        else a `QuantizedStack` of each run of one type's; None unless all share width and
        ``int8_activations``."""
        first = parts[0]
        if any((p.in_features, p.int8_activations)
               != (first.in_features, first.int8_activations) for p in parts):
            return None
        runs = [QuantizedWeight(torch.cat([p.blocks for p in run]).contiguous(), qtype,
                                first.in_features, first.int8_activations)
                for qtype, run in groupby(parts, lambda p: p.qtype)]
        return runs[0] if len(runs) == 1 else QuantizedStack(tuple(runs))


@dataclass(eq=False)
class QuantizedStack(KeptWeight):
    """`QuantizedWeight`s of one width and several types, their rows one after another (a
    Q4_K_M layer's Q4_K q and k beside a Q6_K v), standing in for the fused weight: each
    part multiplies into its own columns of the product."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].in_features))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def int8_activations(self) -> bool:
        return self.parts[0].int8_activations

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def quantized_linear(x: torch.Tensor, w: KeptWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ w.T + bias`` for float32 CPU ``x`` (rows may be strided); other
    dtypes multiply the dequantized weight."""
    if isinstance(w, QuantizedStack):
        y = torch.cat([quantized_linear(x, p) for p in w.parts], dim=-1)
        return y if bias is None else y + bias
    lib = _kernel(w.qtype)
    if x.dtype is not torch.float32 or lib is None or not x.is_cpu:
        y = torch.nn.functional.linear(x, w.dequantize().to(x.dtype))
        return y if bias is None else y + bias
    # a decode step calls this some 120 times with one row: every torch call counts here
    flat = x.dim() == 2
    rows = x if flat and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
    num_rows, width = rows.shape
    out_features = w.blocks.shape[0]
    if width != w.in_features:
        raise RuntimeError(f"quantized linear: input rows of {width} values, "
                           f"weight rows of {w.in_features}")
    if num_rows >= DEQUANTIZED_ROWS:
        y = torch.nn.functional.linear(rows, w.dequantize(_scratch(out_features * width)),
                                       bias)
        return y if flat else y.view(*x.shape[:-1], out_features)
    y = torch.empty(num_rows, out_features)
    if num_rows:
        kernel = (lib.heron_quant_linear_int8
                  if w.int8_activations and num_rows <= QUANT_TYPES[w.qtype].int8_rows
                  else lib.heron_quant_linear)
        kernel(rows.data_ptr(), rows.stride(0), w.blocks.data_ptr(), y.data_ptr(),
               out_features, num_rows, out_features, width)
    if bias is not None:
        y += bias
    return y if flat else y.view(*x.shape[:-1], out_features)


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 buffer of at least ``numel`` elements, for a weight dequantized
    for one product (a fresh one each time would fault its pages in every call)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel)
    return buf


def kernel_available(qtype: int) -> bool:
    """Whether ``qtype`` weights multiply through the compiled kernel on this machine."""
    return qtype in QUANT_TYPES and _kernel(qtype) is not None


@functools.cache
def _kernel(qtype: int, vec_floats: int | None = None):
    """The kernel for ``qtype``; ``vec_floats`` (8, 16) picks its tile's vector width rather
    than the machine's register width."""
    lib = cpu_kernels.load("quant_linear_cpu.cpp", {"QTYPE": qtype}, vec_floats)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.heron_quant_linear.argtypes = [p, i64, p, p, i64, i64, i64, i64]
    lib.heron_quant_linear_int8.argtypes = [p, i64, p, p, i64, i64, i64, i64]
    lib.heron_quant_linear.restype = lib.heron_quant_linear_int8.restype = None
    lib.heron_dequantize.argtypes = [p, p, i64, i64]
    lib.heron_dequantize.restype = None
    return lib
