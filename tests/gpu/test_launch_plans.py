"""CPU checks of the CUDA op package: launch plans, import hygiene, argument packing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from heron.core.ops.cuda import launch, plan


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("max_seq_len", [0, 1, 63, 64, 65, 1000, 4096, 131072])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 128), (16, 256)])
@pytest.mark.parametrize("dtype_code", [0, 2])
def test_decode_plan_covers_the_context(num_seqs, max_seq_len, group, head_dim, dtype_code):
    p = plan.plan_decode(num_seqs, 8, max_seq_len, 132, group, head_dim, dtype_code)
    assert 1 <= p.partition_size <= p.partition_max
    assert p.partition_size * p.max_splits >= max(1, max_seq_len)
    assert (p.max_splits - 1) * p.partition_size < max(1, max_seq_len)  # no idle split
    elem = 4 if dtype_code == 0 else 2
    step = plan.decode_keys_per_step(p.mma, p.warps, p.unroll, p.key_lanes, head_dim, elem)
    assert p.partition_size % step == 0  # every warp gets the same number of steps
    assert plan.decode_smem_bytes(group, head_dim, p.warps) <= plan.STATIC_SMEM_LIMIT


def test_decode_plan_fills_the_gpu_at_batch_one():
    p = plan.plan_decode(1, 8, 4096, 132, 4, 128)
    # about one CTA per SM for a single long sequence (partitions round up to whole CTA steps)
    assert (p.max_splits + 1) * 8 >= 132


@pytest.mark.parametrize("dtype_code,head_dim,group,mma", [
    (2, 128, 4, True), (1, 64, 1, True), (1, 128, 16, True), (0, 128, 4, False),
    (2, 96, 7, False), (2, 256, 2, False), (2, 128, 32, False)])
def test_decode_plan_picks_tensor_cores_where_supported(dtype_code, head_dim, group, mma):
    assert plan.DECODE_CONFIG.kernel == "auto"
    with plan.decode_config(kernel="auto"):
        p = plan.plan_decode(16, 8, 1024, 132, group, head_dim, dtype_code)
    assert p.mma is mma and p.defines["DECODE_MMA"] == int(mma)
    assert p.defines["DECODE_UNROLL"] == (2 if mma else 4)
    with plan.decode_config(kernel="fma"):
        assert not plan.plan_decode(16, 8, 1024, 132, group, head_dim, dtype_code).mma
    if not mma:
        with plan.decode_config(kernel="mma"), pytest.raises(ValueError, match="tensor-core"):
            plan.plan_decode(16, 8, 1024, 132, group, head_dim, dtype_code)


def test_decode_config_overrides_and_restores():
    default = plan.DECODE_CONFIG
    with plan.decode_config(kernel="auto", warps=8, unroll=2, prefetch=True,
                            partition_size=100) as cfg:
        assert plan.DECODE_CONFIG is cfg
        p = plan.plan_decode(3, 8, 1000, 132, 4, 128)
        assert (p.partition_size, p.max_splits, p.threads) == (100, 10, 256)
        assert p.defines == {"DECODE_MMA": 1, "DECODE_WARPS": 8, "DECODE_UNROLL": 2,
                             "DECODE_KEY_LANES": 0, "DECODE_PREFETCH": 1, "DECODE_MIN_BLOCKS": 1}
    assert plan.DECODE_CONFIG is default
    with pytest.raises(ValueError, match="key_lanes"):
        plan.DecodeConfig(key_lanes=3)


def test_decode_plan_partition_knobs():
    # Batch 1, 1k context, 132 SMs: min_partition bounds the split from below ...
    small = plan.plan_decode(1, 8, 1024, 132, 4, 128, config=plan.DecodeConfig(min_partition=256))
    assert small.partition_size == 256 and small.max_splits == 4
    # ... max_partition from above (batch 256 would otherwise take the whole context).
    big = plan.plan_decode(256, 8, 4096, 132, 4, 128, config=plan.DecodeConfig(max_partition=512))
    assert big.partition_size == 512 and big.max_splits == 8
    # More CTAs per SM -> more, shorter partitions.
    few = plan.plan_decode(16, 8, 1024, 132, 4, 128, config=plan.DecodeConfig(ctas_per_sm=1))
    many = plan.plan_decode(16, 8, 1024, 132, 4, 128, config=plan.DecodeConfig(ctas_per_sm=8))
    assert few.max_splits < many.max_splits


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("max_smem", [48 * 1024, 99 * 1024, 227 * 1024])
def test_prefill_tile_fits(head_dim, max_smem):
    block_m, block_n = plan.plan_prefill_tile(head_dim, max_smem)
    assert plan.prefill_smem_bytes(block_m, block_n, head_dim) <= max_smem
    assert block_m % 16 == 0 and block_n % 8 == 0


def test_importing_the_cuda_ops_does_not_import_cupy():
    code = ("import sys, heron.core.ops.cuda, heron.core.kernels; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pack_wants_typed_scalars():
    t = torch.zeros(4)
    assert launch._pack(t) == np.uint64(t.data_ptr())
    assert launch._pack(None) == np.uint64(0)
    assert launch._pack(launch.i32(3)).dtype == np.int32
    with pytest.raises(TypeError, match="i32"):
        launch._pack(3)


def test_dtype_codes():
    assert [launch.dtype_code(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == [0, 1, 2]
    assert launch.vec_elems(torch.bfloat16) == 8 and launch.vec_elems(torch.float32) == 4
    with pytest.raises(TypeError):
        launch.dtype_code(torch.int8)
