"""Launch shapes for the attention kernels: pure arithmetic, testable without a GPU.

The decode plan depends only on (num_seqs, num_kv_heads, max_seq_len, device SM count,
group size, head dim, dtype) and the tuning knobs of `DecodeConfig`, never on the
per-sequence lengths, so one CUDA graph per (num_seqs, max_seq_len bound) stays valid while
the lengths grow underneath it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Iterator

#: Shared memory a kernel may use without opting in (the attention kernels' static buffers).
STATIC_SMEM_LIMIT = 48 * 1024
#: Prefill tiles (BLOCK_M rows, BLOCK_N keys), best first.
PREFILL_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8))


# ---------------------------------------------------------------------------- decode

#: Defaults of `DecodeConfig`: aim for DECODE_CTAS_PER_SM CTAs per SM (so batch 1 with a long
#: context still fills the GPU), each taking between MIN_PARTITION (0: one CTA step of keys)
#: and MAX_PARTITION keys of a context. Fitted on an H200 (bench/gpu_bench.py's decode sweep,
#: bench/results/h200-2026-12-04): at Llama-3-8B shapes one CTA per SM with whole-context
#: partitions streams the KV fastest once the batch fills the GPU.
DECODE_CTAS_PER_SM = 1
MIN_PARTITION = 0
MAX_PARTITION = 1024
#: Head dims / group sizes the tensor-core decode path takes (registers: see the kernel).
DECODE_MMA_MAX_HEAD_DIM = 128
DECODE_MMA_MAX_GROUP = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of attention_decode.cu. Every setting computes the same function.

    ``kernel``: "mma" (tensor cores; float16 / bfloat16, head_dim a multiple of 64 up to
    DECODE_MMA_MAX_HEAD_DIM, group <= 16), "fma" (CUDA cores, anything) or "auto" (mma where
    supported). ``ctas_per_sm``, ``min_partition``, ``max_partition``: how contexts are split
    (see `plan_decode`); ``partition_size`` > 0 forces a partition size (sweeps, tests).
    ``warps`` per CTA; ``unroll``: rows in flight (keys per lane group for fma, 16-key chunks
    per warp step for mma; 0 = 4 / 2); ``key_lanes``: fma lanes per key
    row (0 = auto); ``prefetch``: load the next step before computing this one;
    ``min_blocks``: CTAs per SM the compiler must fit in registers (1 = no cap).
    """

    kernel: str = "auto"
    ctas_per_sm: float = DECODE_CTAS_PER_SM
    min_partition: int = MIN_PARTITION
    max_partition: int = MAX_PARTITION
    partition_size: int = 0
    warps: int = 4
    unroll: int = 0
    key_lanes: int = 0
    prefetch: bool = False
    min_blocks: int = 1

    def __post_init__(self) -> None:
        checks = (
            (self.kernel in ("auto", "mma", "fma"), "kernel must be auto, mma or fma"),
            (self.ctas_per_sm > 0, "ctas_per_sm must be > 0"),
            (self.min_partition >= 0 and self.max_partition >= 1, "partition bounds must be >= 0 / 1"),
            (self.partition_size >= 0, "partition_size must be >= 0"),
            (1 <= self.warps <= 32, "warps must be in 1..32"),
            (self.unroll >= 0, "unroll must be >= 0"),
            (self.key_lanes in (0, 1, 2, 4, 8, 16, 32), "key_lanes must be 0 or a power of two <= 32"),
            (self.min_blocks >= 1, "min_blocks must be >= 1"),
        )
        for ok, why in checks:
            if not ok:
                raise ValueError(f"DecodeConfig: {why} ({self})")


#: The decode knobs in force; `decode_config` overrides them for a block (benchmarks, tests).
#: $HERON_DECODE_KERNEL (fma|mma|auto) sets the kernel at import.
DECODE_CONFIG = DecodeConfig(kernel=os.environ.get("HERON_DECODE_KERNEL", "auto").lower())


@contextlib.contextmanager
def decode_config(config: DecodeConfig | None = None, **overrides) -> Iterator[DecodeConfig]:
    """Run the block with ``config`` (default: the current one) updated by ``overrides``."""
    global DECODE_CONFIG
    previous = DECODE_CONFIG
    DECODE_CONFIG = dataclasses.replace(config or previous, **overrides)
    try:
        yield DECODE_CONFIG
    finally:
        DECODE_CONFIG = previous


@dataclass(frozen=True)
class DecodePlan:
    """``partition_size`` keys per CTA, ``max_splits`` CTAs per (sequence, kv head).

    With ``max_splits == 1`` the decode kernel writes the output itself and no reduce kernel
    runs. ``partition_max`` is the largest partition the plan would choose (the config's
    bound, rounded up to whole CTA steps). ``defines`` are the kernel's knob defines,
    ``threads`` its block size.
    """

    partition_size: int
    max_splits: int
    partition_max: int
    mma: bool = False
    warps: int = 4
    unroll: int = 4
    key_lanes: int = 0
    prefetch: bool = False
    min_blocks: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def defines(self) -> dict[str, int]:
        return {"DECODE_MMA": int(self.mma), "DECODE_WARPS": self.warps,
                "DECODE_UNROLL": self.unroll, "DECODE_KEY_LANES": self.key_lanes,
                "DECODE_PREFETCH": int(self.prefetch), "DECODE_MIN_BLOCKS": self.min_blocks}


def decode_mma_supported(dtype_code: int, head_dim: int, group_size: int) -> bool:
    """Whether the tensor-core decode path takes this cache dtype (1 fp16, 2 bf16) and shape."""
    return (dtype_code in (1, 2) and head_dim % 64 == 0 and head_dim <= DECODE_MMA_MAX_HEAD_DIM
            and group_size <= DECODE_MMA_MAX_GROUP)


def decode_keys_per_step(mma: bool, warps: int, unroll: int, key_lanes: int, head_dim: int,
                         elem_size: int) -> int:
    """Keys one CTA covers per step of its loop (all warps, all rows in flight)."""
    if mma:
        return warps * 16 * unroll
    nvec = head_dim * elem_size // 16
    lanes = key_lanes or min(32, 1 << max(0, nvec - 1).bit_length())  # AUTO_LANES
    return warps * (32 // lanes) * unroll


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                group_size: int, head_dim: int, dtype_code: int = 2,
                config: DecodeConfig | None = None) -> DecodePlan:
    """Split each context so that the grid has about ``ctas_per_sm`` CTAs per SM.

    The partition size is a whole number of CTA steps (so every warp gets equal work), at
    least ``min_partition`` and at most ``max_partition`` keys (both rounded up to whole
    steps), and as small as gives the wanted number of CTAs; ``config.partition_size`` > 0
    overrides it. Uses `DECODE_CONFIG` when ``config`` is None.
    """
    cfg = config or DECODE_CONFIG
    supported = decode_mma_supported(dtype_code, head_dim, group_size)
    if cfg.kernel == "mma" and not supported:
        raise ValueError(f"the tensor-core decode kernel takes float16/bfloat16, head_dim a multiple "
                         f"of 64 <= {DECODE_MMA_MAX_HEAD_DIM} and group <= {DECODE_MMA_MAX_GROUP}; "
                         f"got dtype code {dtype_code}, head_dim {head_dim}, group {group_size}")
    mma = cfg.kernel == "mma" or (cfg.kernel == "auto" and supported)
    unroll = cfg.unroll or (2 if mma else 4)
    elem_size = 4 if dtype_code == 0 else 2
    step = decode_keys_per_step(mma, cfg.warps, unroll, cfg.key_lanes, head_dim, elem_size)
    max_seq_len = max(1, max_seq_len)
    lo = max(1, -(-cfg.min_partition // step)) * step
    hi = max(lo, -(-cfg.max_partition // step) * step)
    if cfg.partition_size:
        size = cfg.partition_size
    else:
        ctas_per_split = max(1, num_seqs * num_kv_heads)
        splits_wanted = max(1, math.ceil(cfg.ctas_per_sm * num_sms / ctas_per_split))
        size = -(-math.ceil(max_seq_len / splits_wanted) // step) * step
        size = min(max(size, lo), hi)
    return DecodePlan(size, math.ceil(max_seq_len / size), max(hi, size), mma, cfg.warps, unroll,
                      cfg.key_lanes, cfg.prefetch, cfg.min_blocks)


def decode_smem_bytes(group_size: int, head_dim: int, warps: int = 4) -> int:
    """Static shared memory of attention_decode.cu: per-warp max and sum, the merge buffer."""
    row = 4 * group_size * (head_dim + 4)
    per_round = max(1, min(warps, (32 * 1024) // row))
    return 8 * warps * group_size + per_round * row


def prefill_smem_bytes(block_m: int, block_n: int, head_dim: int) -> int:
    """Dynamic shared memory of attention_prefill.cu: Q tile, K/V tile, P tile (float32)."""
    return 4 * (block_m * (head_dim + 4) + block_n * (head_dim + 4) + block_m * (block_n + 4))


def plan_prefill_tile(head_dim: int, max_smem: int) -> tuple[int, int]:
    """The best (BLOCK_M, BLOCK_N) whose shared memory fits ``max_smem`` bytes."""
    for block_m, block_n in PREFILL_TILES:
        if prefill_smem_bytes(block_m, block_n, head_dim) <= max_smem:
            return block_m, block_n
    raise ValueError(f"prefill attention: head_dim {head_dim} does not fit in {max_smem} bytes")


# ---------------------------------------------------------------------------- tensor-core prefill

#: Tensor-core prefill tiles (BLOCK_M rows, BLOCK_N keys, NUM_WARPS), best first; a warp owns
#: BLOCK_M / NUM_WARPS = 16 or 32 rows (attention_prefill_mma.cu). For head 128, bf16, sm_90
#: (ptxas, no spills): 128x64x4 255 registers, 70.7 KB shared memory, 2 CTAs/SM (8 warps);
#: 64x64x4 222 registers, 53.2 KB; 64x32x4 166 registers, 35.3 KB (fits 48 KiB). Not yet
#: timed against each other: bench/gpu_bench.py's prefill section sweeps them (and 128x64x8).
PREFILL_MMA_TILES = ((128, 64, 4), (64, 64, 4), (64, 32, 4))
#: Head dims the tensor-core prefill kernel takes: multiples of 16 up to this.
PREFILL_MMA_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class MmaTile:
    """A launch shape of attention_prefill_mma.cu: the BLOCK_M / BLOCK_N / NUM_WARPS defines."""

    block_m: int
    block_n: int
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


def prefill_mma_supported(dtype_code: int, head_dim: int) -> bool:
    """Whether attention_prefill_mma.cu takes this cache dtype (1 fp16, 2 bf16) and head dim."""
    return (dtype_code in (1, 2) and head_dim % 16 == 0
            and 16 <= head_dim <= PREFILL_MMA_MAX_HEAD_DIM)


def prefill_mma_smem_bytes(block_m: int, block_n: int, head_dim: int) -> int:
    """Dynamic shared memory of attention_prefill_mma.cu: Q, K and V tiles of 16-bit elements
    (rows padded by 16 bytes), then two tables of block_n 64-bit token offsets."""
    return 2 * (block_m + 2 * block_n) * (head_dim + 8) + 16 * block_n


def _mma_tile_ok(tile: MmaTile, head_dim: int, max_smem: int) -> bool:
    rows = tile.block_m // tile.num_warps
    if tile.block_m % tile.num_warps or rows not in (16, 32):
        return False
    if tile.block_n % 16 or tile.block_n > tile.threads:  # the token-offset table: one pass
        return False
    if head_dim > 128 and (rows != 16 or tile.block_n > 32):  # registers: O is rows x head_dim
        return False
    return prefill_mma_smem_bytes(tile.block_m, tile.block_n, head_dim) <= max_smem


def plan_prefill_mma(head_dim: int, max_smem: int, rows_per_seq: int = 0, other_ctas: int = 1,
                     num_sms: int = 0) -> MmaTile:
    """The first of PREFILL_MMA_TILES that fits ``max_smem`` (and the register limits).

    When ``num_sms`` is given, prefer the first fitting tile whose grid (``rows_per_seq``
    query rows per sequence, split into row tiles, times ``other_ctas`` = kv heads x
    sequences) has at least one CTA per SM; a small batch then gets smaller tiles.
    """
    fitting = [MmaTile(*t) for t in PREFILL_MMA_TILES
               if _mma_tile_ok(MmaTile(*t), head_dim, max_smem)]
    if not fitting:
        raise ValueError(f"tensor-core prefill: head_dim {head_dim} does not fit in "
                         f"{max_smem} bytes")
    if num_sms:
        for tile in fitting:
            if -(-rows_per_seq // tile.block_m) * other_ctas >= num_sms:
                return tile
        return min(fitting, key=lambda t: t.block_m)
    return fitting[0]
