"""Launch shapes for the attention kernels: pure arithmetic, testable without a GPU.

The decode plan depends only on (num_seqs, num_kv_heads, max_seq_len, device SM count,
group size, head dim), never on the per-sequence lengths, so one CUDA graph per
(num_seqs, max_seq_len bound) stays valid while the lengths grow underneath it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Shared memory a kernel may use without opting in (the attention kernels' static buffers).
STATIC_SMEM_LIMIT = 48 * 1024
#: Smallest / largest number of keys one decode CTA handles.
MIN_PARTITION = 64
MAX_PARTITION = 512
#: Aim for this many decode CTAs per SM so batch 1 with a long context still fills the GPU.
DECODE_CTAS_PER_SM = 2
#: Prefill tiles (BLOCK_M rows, BLOCK_N keys), best first.
PREFILL_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8))


@dataclass(frozen=True)
class DecodePlan:
    """``partition_size`` keys per CTA, ``max_splits`` CTAs per (sequence, kv head).

    ``partition_max`` is the kernel's compile-time bound (PARTITION_MAX) on
    ``partition_size``. With ``max_splits == 1`` the decode kernel writes the output itself
    and no reduce kernel runs.
    """

    partition_size: int
    max_splits: int
    partition_max: int


def decode_smem_bytes(group_size: int, head_dim: int, partition_max: int) -> int:
    """Static shared memory of attention_decode.cu: logits, the reduction row, max and sum."""
    return 4 * (group_size * partition_max + group_size * head_dim + 2 * group_size)


def decode_partition_max(group_size: int, head_dim: int) -> int:
    """The largest power-of-two PARTITION_MAX <= MAX_PARTITION whose buffers fit 48 KiB."""
    pm = MAX_PARTITION
    while decode_smem_bytes(group_size, head_dim, pm) > STATIC_SMEM_LIMIT:
        pm //= 2
        if pm < MIN_PARTITION:
            raise ValueError(f"decode attention: group size {group_size} x head_dim {head_dim} "
                             "does not fit in shared memory")
    return pm


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                group_size: int, head_dim: int) -> DecodePlan:
    """Split each context so that the grid has about DECODE_CTAS_PER_SM CTAs per SM."""
    partition_max = decode_partition_max(group_size, head_dim)
    max_seq_len = max(1, max_seq_len)
    ctas_per_split = max(1, num_seqs * num_kv_heads)
    splits_wanted = max(1, math.ceil(DECODE_CTAS_PER_SM * num_sms / ctas_per_split))
    size = 1 << max(0, math.ceil(max_seq_len / splits_wanted) - 1).bit_length()  # next pow2
    size = min(max(size, MIN_PARTITION), partition_max)
    return DecodePlan(size, math.ceil(max_seq_len / size), partition_max)


def prefill_smem_bytes(block_m: int, block_n: int, head_dim: int) -> int:
    """Dynamic shared memory of attention_prefill.cu: Q tile, K/V tile, P tile (float32)."""
    return 4 * (block_m * (head_dim + 4) + block_n * (head_dim + 4) + block_m * (block_n + 4))


def plan_prefill_tile(head_dim: int, max_smem: int) -> tuple[int, int]:
    """The best (BLOCK_M, BLOCK_N) whose shared memory fits ``max_smem`` bytes."""
    for block_m, block_n in PREFILL_TILES:
        if prefill_smem_bytes(block_m, block_n, head_dim) <= max_smem:
            return block_m, block_n
    raise ValueError(f"prefill attention: head_dim {head_dim} does not fit in {max_smem} bytes")
