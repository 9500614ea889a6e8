"""Model-math ops shared by families: torch reference on CPU, CuPy kernels on CUDA.

Each public op dispatches on the device of its first tensor argument; ``*_ref`` is the
torch implementation and the oracle for the CUDA kernel of the same name. A plugin's own
kernels run through `launch_kernel` (see `heron.core.ops.cuda.launch`), with scalars typed
by `i32` / `i64` / `f32` and the element type chosen by ``HERON_DTYPE=dtype_code(dtype)``.
"""

from heron.core.ops.activation import silu_and_mul, silu_and_mul_ref
from heron.core.ops.attention import (paged_attention, paged_attention_ref, rotary_write_kv,
                                      rotary_write_kv_ref, write_kv, write_kv_ref)
from heron.core.ops.cuda.launch import dtype_code, f32, i32, i64, packed_rows
from heron.core.ops.cuda.launch import launch as launch_kernel
from heron.core.ops.linear import linear, pack_weight
from heron.core.ops.norm import rms_norm, rms_norm_ref
from heron.core.ops.packed_attention import packed_attention
from heron.core.ops.rotary import (rope_cos_sin_cache, rope_inv_freq, rope_type, rotary,
                                   rotary_ref)

__all__ = [
    "dtype_code", "f32", "i32", "i64", "launch_kernel", "linear", "pack_weight",
    "packed_attention", "packed_rows",
    "paged_attention", "paged_attention_ref", "rms_norm", "rms_norm_ref", "rope_cos_sin_cache",
    "rope_inv_freq", "rope_type", "rotary", "rotary_ref", "rotary_write_kv", "rotary_write_kv_ref",
    "silu_and_mul", "silu_and_mul_ref", "write_kv", "write_kv_ref",
]
