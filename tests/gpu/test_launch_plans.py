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
def test_decode_plan_covers_the_context(num_seqs, max_seq_len, group, head_dim):
    p = plan.plan_decode(num_seqs, 8, max_seq_len, 132, group, head_dim)
    assert plan.MIN_PARTITION <= p.partition_size <= p.partition_max
    assert p.partition_size * p.max_splits >= max(1, max_seq_len)
    assert (p.max_splits - 1) * p.partition_size < max(1, max_seq_len)  # no idle split
    assert plan.decode_smem_bytes(group, head_dim, p.partition_max) <= plan.STATIC_SMEM_LIMIT


def test_decode_plan_fills_the_gpu_at_batch_one():
    p = plan.plan_decode(1, 8, 4096, 132, 4, 128)
    assert p.max_splits * 8 >= 132  # at least one CTA per SM for a single long sequence


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
