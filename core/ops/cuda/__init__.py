"""CUDA implementations of heron's model ops, as CuPy RawKernels over torch tensors.

Each function has the signature and semantics of the ``*_ref`` op of the same name in
`heron.core.ops`; `heron.core.ops` dispatches here when its tensors are on a CUDA device.
Importing this package imports torch and numpy only; cupy is imported at the first launch.
"""

from heron.core.ops.cuda.activation import silu_and_mul
from heron.core.ops.cuda.attention import paged_attention
from heron.core.ops.cuda.cache import write_kv
from heron.core.ops.cuda.lora import add_lora_rows
from heron.core.ops.cuda.norm import rms_norm
from heron.core.ops.cuda.rotary import rotary, rotary_write_kv

__all__ = ["add_lora_rows", "paged_attention", "rms_norm", "rotary", "rotary_write_kv",
           "silu_and_mul", "write_kv"]
