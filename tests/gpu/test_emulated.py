"""The CUDA kernels run on CPU threads (tests/gpu/emulator) against their torch references.

Not GPU tests: they run wherever g++ is, driving the very op code of `heron.core.ops.cuda`
through the emulator backend, on small shapes (every CUDA thread is a real thread). They
catch indexing, masking, barrier and argument-list mistakes; tests/gpu/test_kernels.py
checks the same on a real device.
"""

from __future__ import annotations

import pytest
import torch

from heron.core.ops.cuda.launch import use_backend
from tests.gpu import cases
from tests.gpu.emulator import EmulatorBackend, compiler_available

pytestmark = pytest.mark.skipif(not compiler_available(), reason="needs g++ for the kernel emulator")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def backend():
    return EmulatorBackend(num_sms=4)


@pytest.fixture
def emulated(backend):
    backend.launches.clear()
    with use_backend(backend):
        yield backend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(emulated, dtype, with_residual):
    cases.check_rms_norm("cpu", dtype, 3, 200, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(emulated, dtype):
    cases.check_silu_and_mul("cpu", dtype, 3, 300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim,fused", [(64, True), (32, False)])
def test_rotary(emulated, dtype, rot_dim, fused):
    cases.check_rotary("cpu", dtype, 5, 4, 2, 64, rot_dim, fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(emulated, dtype):
    cases.check_write_kv("cpu", dtype, 20, 2, 64, 16)


# Small attention cases: (dtype, head_dim, Hq, Hkv, block_size, query_lens, seq_lens).
DECODE = [
    (torch.float32, 64, 4, 2, 16, [1, 1, 1], [1, 70, 300]),       # 3 splits, reduce kernel
    (torch.bfloat16, 128, 4, 1, 32, [1, 1], [33, 200]),             # GQA 4, head 128
    (torch.float16, 64, 8, 1, 16, [1], [40]),                       # GQA 8, direct (1 split)
    (torch.float32, 32, 2, 2, 16, [1, 1], [5, 129]),                # head 32: 8 keys per warp
    (torch.float16, 96, 7, 1, 16, [1, 1], [50, 130]),               # head 96 (idle lanes), GQA 7
]
PREFILL = [
    (torch.float32, 64, 4, 2, 16, [5, 40, 1], [5, 40, 1]),           # fresh prompts, varlen
    (torch.float32, 64, 4, 2, 16, [3, 17, 1], [40, 50, 77]),         # chunked + a decode row
    (torch.bfloat16, 128, 4, 1, 32, [9, 1], [70, 33]),               # GQA 4, head 128
    (torch.float16, 96, 3, 3, 16, [20], [20]),                       # head 96, MHA
    (torch.bfloat16, 64, 7, 1, 16, [10, 3], [30, 3]),                # GQA 7: rows straddle tokens
]


@pytest.mark.parametrize("dtype,d,hq,hkv,bs,qlens,slens", DECODE)
def test_decode_attention(emulated, dtype, d, hq, hkv, bs, qlens, slens):
    cases.check_paged_attention("cpu", dtype, qlens, slens, num_q_heads=hq, num_kv_heads=hkv,
                                head_dim=d, block_size=bs)
    assert emulated.launches[0][0] == "paged_decode_kernel"


def test_decode_context_bound(emulated):
    """A graph-style bound above every real length: same grid for any lengths below it."""
    cases.check_paged_attention("cpu", torch.float32, [1, 1], [20, 90], num_q_heads=4,
                                num_kv_heads=2, head_dim=64, block_size=16, max_seq_len=400)
    (name, grid, _, _), (reduce_name, _, _, _) = emulated.launches
    assert (name, reduce_name) == ("paged_decode_kernel", "paged_decode_reduce_kernel")
    assert grid[0] > 1


@pytest.mark.parametrize("smem", [227 * 1024, 48 * 1024])
@pytest.mark.parametrize("dtype,d,hq,hkv,bs,qlens,slens", PREFILL)
def test_prefill_attention(emulated, smem, dtype, d, hq, hkv, bs, qlens, slens):
    emulated.info = emulated.info._replace(max_smem_per_block=smem)
    try:
        cases.check_paged_attention("cpu", dtype, qlens, slens, num_q_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, block_size=bs)
    finally:
        emulated.info = emulated.info._replace(max_smem_per_block=227 * 1024)
    assert emulated.launches[0][0] == "paged_prefill_kernel"


@pytest.mark.parametrize("seq_lens,bound", [((300, 1, 77), 512), ((40, 1, 17), 64)])
def test_decode_padded_rows(emulated, seq_lens, bound):
    cases.check_decode_padded_rows("cpu", torch.float32, seq_lens, bound)
