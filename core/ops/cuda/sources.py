"""Core's kernel sources, registered with the loader for compile checks.

Each file is checked in a few representative variants (dtype, head dim, GQA group, KV
block size); at run time the ops request whichever variant a model needs.
"""

from __future__ import annotations

from heron.core.kernels import register_kernel_file
from heron.core.ops.cuda.launch import KERNEL_DIR

ALL_DTYPES = [{"HERON_DTYPE": code} for code in (0, 1, 2)]

# (dtype, head_dim, group, block_size): Llama-3 bf16, a small fp16 MHA model, fp32 with
# GQA 8, a 256-dim head, and odd sizes (head 96, group 7 as in Qwen2.5-7B).
_ATTENTION_SHAPES = ((2, 128, 4, 16), (1, 64, 1, 32), (0, 128, 8, 16), (2, 256, 2, 16),
                     (1, 96, 7, 16))


def _attention(**extra) -> list[dict]:
    return [{"HERON_DTYPE": dt, "HEAD_DIM": d, "GROUP_SIZE": g, "BLOCK_SIZE": bs, **extra}
            for dt, d, g, bs in _ATTENTION_SHAPES]


# RMSNorm: 16-byte items (one or two a thread) and the element-wise fallback.
register_kernel_file(KERNEL_DIR / "norm.cu", ["rms_norm_kernel"],
                     [{**d, "HERON_NORM_VEC": vec, "HERON_NORM_ITEMS": items}
                      for d in ALL_DTYPES for vec, items in ((1, 1), (1, 2), (0, 4))])
register_kernel_file(KERNEL_DIR / "activation.cu", ["silu_and_mul_kernel"],
                     [{**d, "HERON_ACT_VEC": vec} for d in ALL_DTYPES for vec in (1, 0)])
register_kernel_file(KERNEL_DIR / "rotary.cu", ["rotary_kernel"], ALL_DTYPES)
register_kernel_file(KERNEL_DIR / "cache.cu", ["write_kv_kernel"], ALL_DTYPES)
register_kernel_file(KERNEL_DIR / "lora.cu", ["lora_shrink_kernel", "lora_expand_kernel"],
                     ALL_DTYPES)
# Decode: every shape on CUDA cores (the kernel's defaults), the tensor-core path where it
# applies, and non-default knobs (plan.DecodeConfig) on the Llama shape.
_DECODE_KNOBS = ({"DECODE_MMA": 1}, {"DECODE_MMA": 1, "DECODE_WARPS": 8, "DECODE_UNROLL": 2,
                                     "DECODE_PREFETCH": 1},
                 {"DECODE_MMA": 1, "DECODE_WARPS": 2, "DECODE_MIN_BLOCKS": 3},
                 {"DECODE_KEY_LANES": 8, "DECODE_UNROLL": 2, "DECODE_PREFETCH": 1, "DECODE_WARPS": 8})
register_kernel_file(KERNEL_DIR / "attention_decode.cu",
                     ["paged_decode_kernel", "paged_decode_reduce_kernel"],
                     _attention() + [{**_attention()[0], **k} for k in _DECODE_KNOBS]
                     + [{**_attention()[1], "DECODE_MMA": 1},
                        {"HERON_DTYPE": 1, "HEAD_DIM": 128, "GROUP_SIZE": 16, "BLOCK_SIZE": 16,
                         "DECODE_MMA": 1}])
register_kernel_file(KERNEL_DIR / "attention_prefill.cu", ["paged_prefill_kernel"],
                     _attention(BLOCK_M=64, BLOCK_N=64) + _attention(BLOCK_M=32, BLOCK_N=32)[:1])

# Tensor-core prefill (float16 / bfloat16 only): (dtype, head_dim, group, block_size, tile).
_MMA_SHAPES = ((2, 128, 4, 16, (128, 64, 4)), (2, 128, 4, 16, (128, 64, 8)),
               (2, 128, 4, 32, (64, 64, 4)), (1, 128, 8, 16, (64, 32, 4)), (1, 64, 1, 32, (128, 64, 4)),
               (2, 96, 7, 16, (64, 64, 4)), (2, 256, 2, 16, (64, 32, 4)), (1, 80, 2, 16, (128, 64, 4)))
register_kernel_file(KERNEL_DIR / "attention_prefill_mma.cu", ["paged_prefill_mma_kernel"],
                     [{"HERON_DTYPE": dt, "HEAD_DIM": d, "GROUP_SIZE": g, "BLOCK_SIZE": bs,
                       "BLOCK_M": bm, "BLOCK_N": bn, "NUM_WARPS": w}
                      for dt, d, g, bs, (bm, bn, w) in _MMA_SHAPES])
