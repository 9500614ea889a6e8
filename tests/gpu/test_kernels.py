"""Every CUDA kernel against its torch reference on a real device (skipped without one).

Inputs are fresh random tensors; outputs are poisoned with NaN before each run and must be
fully written; errors are relative norms against the reference computed in float32 from
the same inputs (see cases.TOL).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu import cases, decode_cases, mamba_cases

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention


def _lens(n: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, hi) for _ in range(n)]


# ---------------------------------------------------------------------------- pointwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (37, 576), (300, 5120), (5, 9000), (3, 1001)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, rows, hidden, with_residual):
    cases.check_rms_norm(DEV, dtype, rows, hidden, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 14336), (77, 1536), (5, 1001)])
def test_silu_and_mul(dtype, rows, inter):
    cases.check_silu_and_mul(DEV, dtype, rows, inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,d,rot,fused", [
    (1, 32, 8, 128, 128, True), (300, 32, 8, 128, 64, True), (17, 9, 3, 64, 64, False)])
def test_rotary(dtype, tokens, hq, hkv, d, rot, fused):
    cases.check_rotary(DEV, dtype, tokens, hq, hkv, d, rot, fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,d,rot,bs", [
    (1, 32, 8, 128, 128, 16), (300, 32, 8, 128, 64, 16), (17, 9, 3, 64, 64, 32)])
def test_rotary_write_kv(dtype, tokens, hq, hkv, d, rot, bs):
    cases.check_rotary_write_kv(DEV, dtype, tokens, hq, hkv, d, rot, bs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hkv,d,bs", [(100, 8, 128, 16), (37, 2, 64, 32)])
def test_write_kv(dtype, tokens, hkv, d, bs):
    cases.check_write_kv(DEV, dtype, tokens, hkv, d, bs)


# ---------------------------------------------------------------------------- attention

# (dtype, heads, block_size, query_lens, seq_lens)
DECODE = [
    (torch.bfloat16, LLAMA, 16, [1] * 4, [1, 17, 1000, 4096]),
    (torch.bfloat16, LLAMA, 16, [1], [4096]),                                   # batch 1, long
    (torch.bfloat16, LLAMA, 16, [1] * 8, _lens(8, 64, 1)),                      # single split
    (torch.float32, dict(num_q_heads=8, num_kv_heads=8, head_dim=64), 32, [1] * 3, [5, 300, 2049]),
    (torch.float16, dict(num_q_heads=32, num_kv_heads=4, head_dim=128), 32, [1] * 64, _lens(64, 1024, 2)),
    (torch.bfloat16, dict(num_q_heads=16, num_kv_heads=2, head_dim=64), 16, [1] * 16, _lens(16, 2000, 3)),
    (torch.float32, LLAMA, 16, [1] * 256, _lens(256, 1024, 4)),
    (torch.bfloat16, dict(num_q_heads=8, num_kv_heads=4, head_dim=256), 16, [1] * 5, _lens(5, 3000, 5)),
    (torch.float16, dict(num_q_heads=28, num_kv_heads=4, head_dim=96), 16, [1] * 3, [7, 700, 1500]),
]

PREFILL = [
    (torch.bfloat16, LLAMA, 16, [4096], [4096]),                                # one long prompt
    (torch.bfloat16, LLAMA, 16, [1, 7, 64, 300], [1, 7, 64, 300]),              # varlen prompts
    (torch.bfloat16, LLAMA, 16, [50, 128, 1, 33], [250, 1128, 518, 33]),        # chunked + decode
    (torch.float32, dict(num_q_heads=8, num_kv_heads=8, head_dim=64), 32, [100, 3, 1], [612, 3, 90]),
    (torch.float16, dict(num_q_heads=32, num_kv_heads=4, head_dim=128), 32, [256, 17], [2048, 17]),
    (torch.bfloat16, dict(num_q_heads=16, num_kv_heads=2, head_dim=64), 16, [500, 1, 1, 1], [900, 44, 1000, 3000]),
    (torch.float32, dict(num_q_heads=8, num_kv_heads=4, head_dim=256), 16, [70], [200]),
    (torch.float16, dict(num_q_heads=28, num_kv_heads=4, head_dim=96), 16, [40, 9], [40, 100]),
]


def _id(case):
    dtype, heads, bs, qlens, slens = case
    g = heads["num_q_heads"] // heads["num_kv_heads"]
    return f"{str(dtype)[6:]}-d{heads['head_dim']}-g{g}-bs{bs}-b{len(qlens)}-max{max(slens)}"


@pytest.mark.parametrize("case", DECODE, ids=_id)
def test_decode_attention(case):
    dtype, heads, bs, qlens, slens = case
    cases.check_paged_attention(DEV, dtype, qlens, slens, block_size=bs, **heads)


def test_decode_context_bound():
    """Graph-style call: max_seq_len is a bound far above the real lengths."""
    cases.check_paged_attention(DEV, torch.bfloat16, [1] * 4, [3, 100, 250, 500], block_size=16,
                                max_seq_len=4096, **LLAMA)


@pytest.mark.parametrize("seq_lens,bound", [((300, 1, 77), 512), ((40, 1, 17), 64)])
def test_decode_padded_rows(seq_lens, bound):
    cases.check_decode_padded_rows(DEV, torch.bfloat16, seq_lens, bound)


@pytest.fixture(params=["opt-in smem", "48 KiB smem"])
def smem_plan(request, monkeypatch):
    """Run prefill with the big tile (opt-in shared memory) and with the 48 KiB tile."""
    if request.param == "48 KiB smem":
        from heron.core.ops.cuda import attention
        real = attention.device_info
        monkeypatch.setattr(attention, "device_info",
                            lambda d: real(d)._replace(max_smem_per_block=48 * 1024))
    return request.param


@pytest.fixture(params=["fma", "auto"])
def prefill_impl(request, monkeypatch):
    """The CUDA-core kernel forced, and the default dispatch (the tensor-core kernel for
    float16 / bfloat16 with head_dim % 16 == 0, when its tile fits the shared memory)."""
    from heron.core.ops.cuda import attention
    monkeypatch.setattr(attention, "PREFILL_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("case", PREFILL, ids=_id)
def test_prefill_attention(case, smem_plan, prefill_impl):
    dtype, heads, bs, qlens, slens = case
    cases.check_paged_attention(DEV, dtype, qlens, slens, block_size=bs, **heads)


# Tensor-core prefill (attention_prefill_mma.cu) with each tile forced; same case format.
PREFILL_MMA = [
    (torch.bfloat16, LLAMA, 16, [4096], [4096]),                                # one long prompt
    (torch.bfloat16, LLAMA, 32, [4096], [4096]),                                # block 32
    (torch.bfloat16, LLAMA, 16, [1, 7, 64, 300, 1000], [1, 7, 64, 300, 1000]),  # varlen prompts
    (torch.bfloat16, LLAMA, 32, [50, 128, 1, 33, 700], [250, 1128, 518, 33, 3000]),  # chunked
    (torch.float16, dict(num_q_heads=32, num_kv_heads=4, head_dim=128), 16, [256, 17], [2048, 17]),
    (torch.bfloat16, dict(num_q_heads=16, num_kv_heads=2, head_dim=64), 16, [500, 1, 1, 1], [900, 44, 1000, 3000]),
    (torch.float16, dict(num_q_heads=28, num_kv_heads=4, head_dim=96), 16, [40, 9, 333], [40, 100, 333]),
    (torch.bfloat16, dict(num_q_heads=32, num_kv_heads=32, head_dim=80), 16, [300, 5], [300, 77]),
]
# Every tile on the Llama-3 cases, two on the others (each tile x shape is one more compile).
MMA_TILES = [(128, 64, 4), (128, 64, 8), (64, 64, 4), (64, 32, 4)]
MMA_PARAMS = [pytest.param(case, tile, id=f"{_id(case)}-{'x'.join(map(str, tile))}")
              for i, case in enumerate(PREFILL_MMA)
              for tile in (MMA_TILES if i < 4 else MMA_TILES[::3])]


@pytest.mark.parametrize("case,tile", MMA_PARAMS)
def test_prefill_attention_mma(case, tile, monkeypatch):
    from heron.core.ops.cuda import attention
    from heron.core.ops.cuda.plan import MmaTile

    monkeypatch.setattr(attention, "PREFILL_KERNEL", "mma")
    monkeypatch.setattr(attention, "PREFILL_MMA_TILE", MmaTile(*tile))
    dtype, heads, bs, qlens, slens = case
    cases.check_paged_attention(DEV, dtype, qlens, slens, block_size=bs, **heads)


def test_prefill_mma_head_256():
    """Head 256 takes the tensor-core kernel only with opt-in shared memory (16-row warps)."""
    from heron.core.ops.cuda import attention

    old = attention.PREFILL_KERNEL
    attention.PREFILL_KERNEL = "mma"
    try:
        cases.check_paged_attention(DEV, torch.bfloat16, [70, 300], [200, 300], block_size=16,
                                    num_q_heads=8, num_kv_heads=4, head_dim=256)
    finally:
        attention.PREFILL_KERNEL = old


def test_prefill_dispatch(monkeypatch):
    """bf16 with head 128 runs the tensor-core kernel by default, float32 the CUDA-core one."""
    from heron.core.ops.cuda import attention

    names = []
    real = attention.launch
    monkeypatch.setattr(attention, "launch",
                        lambda file, name, *a, **k: (names.append(name), real(file, name, *a, **k)))
    monkeypatch.setattr(attention, "PREFILL_KERNEL", None)
    monkeypatch.delenv("HERON_PREFILL_KERNEL", raising=False)
    cases.check_paged_attention(DEV, torch.bfloat16, [100], [100], block_size=16, **LLAMA)
    cases.check_paged_attention(DEV, torch.float32, [100], [100], block_size=16, **LLAMA)
    assert names == ["paged_prefill_mma_kernel", "paged_prefill_kernel"]


def test_public_ops_dispatch_to_cuda():
    """heron.core.ops routes CUDA tensors to the kernels (one smoke call per op)."""
    from heron.core import ops

    x = torch.randn(3, 256, device=DEV)
    out, _ = ops.rms_norm(x, torch.ones(256, device=DEV), 1e-6)
    cases.assert_close(out, ops.rms_norm_ref(x, torch.ones(256, device=DEV), 1e-6)[0],
                       torch.float32, "ops.rms_norm")
    cases.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_ref(x), torch.float32,
                       "ops.silu_and_mul")
    case = cases.make_paged_case([3, 1], [10, 20], block_size=16, dtype=torch.float32,
                                 device=DEV, num_q_heads=4, num_kv_heads=2, head_dim=64)
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    cases.assert_close(out, cases.reference_attention(case), torch.float32, "ops.paged_attention")
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------- decode variants
# Non-default decode plans (tests/gpu/decode_cases.py: the tensor-core and CUDA-core kernels
# with other warps, rows in flight, prefetch, a register cap, other partitions) must compute
# the same function as the default one; a 0 in seq_lens is a padded graph row.
_G8 = dict(num_q_heads=32, num_kv_heads=4, head_dim=128)
_MHA64 = dict(num_q_heads=16, num_kv_heads=16, head_dim=64)
_G16 = dict(num_q_heads=64, num_kv_heads=4, head_dim=128)
# (config name, dtype, heads, block_size, seq_lens, bound): each non-default plan on a few
# shapes (every pair is one more NVRTC compile, ~2 s of the GPU session).
DECODE_VARIANT_CASES = [
    ("mma-w8-u2-prefetch-p96", torch.bfloat16, LLAMA, 16, [0, *_lens(23, 2048, 7)], 2048),
    ("mma-w8-u2-prefetch-p96", torch.float16, _G8, 32, _lens(9, 1500, 8), 4096),
    ("mma-w2-minblocks3-p16..128", torch.bfloat16, LLAMA, 16, [0, *_lens(23, 2048, 7)], 2048),
    ("mma-w2-minblocks3-p16..128", torch.bfloat16, _MHA64, 16, [1, 0, 1500], 2048),
    ("mma-w2-minblocks3-p16..128", torch.bfloat16, _G16, 16, [3000, 5], 4096),
    ("fma-w2-u2-lanes8-prefetch", torch.bfloat16, LLAMA, 16, [0, *_lens(23, 2048, 7)], 2048),
    ("fma-w2-u2-lanes8-prefetch", torch.float32, LLAMA, 16, _lens(6, 1000, 9), 1024),
    ("fma-w8-u1-ctas1", torch.float16, _G8, 32, _lens(9, 1500, 8), 4096),
    ("fma-w8-u1-ctas1", torch.bfloat16, _MHA64, 16, [1, 0, 1500], 2048),
]


def _variant_id(case):
    name, dtype, heads, bs, slens, bound = case
    return f"{name}-{_id((dtype, heads, bs, slens, slens))}-bound{bound}"


@pytest.mark.parametrize("case", DECODE_VARIANT_CASES, ids=_variant_id)
def test_decode_variants(case):
    from heron.core.ops.cuda import plan

    name, dtype, heads, bs, slens, bound = case
    with plan.decode_config(**decode_cases.DECODE_CONFIGS[name]):
        decode_cases.check_decode(DEV, dtype, slens, block_size=bs, max_seq_len=bound,
                                  seed=len(slens), **heads)


@pytest.mark.parametrize("name", ["default", "mma-w8-u2-prefetch-p96", "fma-w2-u2-lanes8-prefetch"])
def test_decode_variant_in_cuda_graph(name):
    """Captured once under a plan, replayed after the lengths change in place (one padded)."""
    from heron.core.ops import cuda as cuda_ops
    from heron.core.ops.cuda import plan

    with plan.decode_config(**decode_cases.DECODE_CONFIGS.get(name, {})):
        case = cases.make_paged_case([1] * 4, [100, 2000, 300, 50], block_size=16,
                                     dtype=torch.bfloat16, device=DEV, max_seq_len=2048, **LLAMA)
        args = (case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        cuda_ops.paged_attention(*args)  # compile and load outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda_ops.paged_attention(*args)
    case.meta.seq_lens.copy_(torch.tensor([90, 2000, 0, 1], dtype=torch.int32))
    case.meta.seq_lens_list = [90, 2000, 0, 1]  # row 2: a padded row, checked against zeros
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[2].float().cpu(), torch.zeros_like(out[2].float().cpu()))
    ref = cases.reference_attention(case)
    cases.assert_close(out[[0, 1, 3]], ref[[0, 1, 3]], torch.bfloat16, f"graph replay {name}")


# ---------------------------------------------------------------------------- Mamba2
# (the hybrid_ssm family's kernels) Bamba-9B's mixer: d_inner 8192, 128 heads of 64, one
# group, state 128, conv 4 wide over 8448 channels, chunks of 256; Nemotron-H's 8 groups.
BAMBA = dict(heads=128, head_dim=64, groups=1, state_size=128)
NEMOTRON = dict(heads=128, head_dim=64, groups=8, state_size=128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[4096], [1, 7, 300, 2049]])
def test_conv1d_prefill(dtype, seq_lens):
    mamba_cases.check_conv1d_prefill(DEV, dtype, seq_lens, 8448, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_conv1d_decode(dtype, batch):
    mamba_cases.check_conv1d_decode(DEV, dtype, batch, 8448, 4, padded=batch > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,shape", [([2048], BAMBA), ([1, 255, 257, 1000], NEMOTRON)])
def test_ssd_prefill(dtype, seq_lens, shape):
    mamba_cases.check_ssd_prefill(DEV, dtype, seq_lens, chunk_size=256, **shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,shape", [(1, BAMBA), (64, NEMOTRON)])  # 4 MB of state each
def test_ssm_decode(dtype, batch, shape):
    mamba_cases.check_ssm_decode(DEV, dtype, batch, **shape, padded=batch > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,norm_before_gate", [(1, False), (8, True)])
def test_gated_rms_norm(dtype, groups, norm_before_gate):
    mamba_cases.check_gated_rms_norm(DEV, dtype, 300, 8192, 8192 // groups, norm_before_gate)


# ---------------------------------------------------------------------------- LoRA
# Llama-3-8B's projections: q (4096 -> 4096), gate/up (4096 -> 14336), down (14336 -> 4096).


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,in_f,out_f,rank,segments", [
    (1, 4096, 4096, 16, [(0, 0, 1)]),
    (64, 4096, 14336, 8, [(3, 0, 20), (1, 20, 21), (0, 40, 64)]),
    (300, 14336, 4096, 64, [(2, 0, 150), (0, 150, 300)])])
def test_lora(dtype, rows, in_f, out_f, rank, segments):
    cases.check_lora(DEV, dtype, rows, in_f, out_f, rank, 4, segments)
