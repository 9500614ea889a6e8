"""The CUDA kernels run on CPU threads (tests/gpu/emulator) against their torch references.

Not GPU tests: they run wherever g++ is, driving the very op code of `heron.core.ops.cuda`
through the emulator backend, on small shapes (every CUDA thread is a real thread). They
catch indexing, masking, barrier and argument-list mistakes; tests/gpu/test_kernels.py
checks the same on a real device.
"""

from __future__ import annotations

import os

import pytest
import torch

from heron.core.ops.cuda import plan
from heron.core.ops.cuda.launch import use_backend
from heron.core.ops.cuda.plan import MmaTile, plan_prefill_mma, prefill_mma_smem_bytes
from tests.gpu import cases, decode_cases, mamba_cases
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
@pytest.mark.parametrize("hidden", [200, 4104, 2055])  # 16-byte items (fp32 4104: 2 a thread); elements
def test_rms_norm(emulated, dtype, with_residual, hidden):
    cases.check_rms_norm("cpu", dtype, 3, hidden, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [296, 300, 37])  # 16-byte items for all dtypes / fp32; elements
def test_silu_and_mul(emulated, dtype, inter):
    cases.check_silu_and_mul("cpu", dtype, 3, inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim,fused", [(64, True), (32, False)])
def test_rotary(emulated, dtype, rot_dim, fused):
    cases.check_rotary("cpu", dtype, 5, 4, 2, 64, rot_dim, fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_write_kv(emulated, dtype, rot_dim):
    cases.check_rotary_write_kv("cpu", dtype, 11, 4, 2, 64, rot_dim, 4)


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
    with plan.decode_config(ctas_per_sm=4):  # 4 CTAs on the emulator's 4 SMs: split the 400
        cases.check_paged_attention("cpu", torch.float32, [1, 1], [20, 90], num_q_heads=4,
                                    num_kv_heads=2, head_dim=64, block_size=16, max_seq_len=400)
    (name, grid, _, _), (reduce_name, _, _, _) = emulated.launches
    assert (name, reduce_name) == ("paged_decode_kernel", "paged_decode_reduce_kernel")
    assert grid[0] > 1


@pytest.fixture
def prefill_kernel(monkeypatch):
    """Force the prefill kernel (attention.PREFILL_KERNEL) and optionally its mma tile."""
    from heron.core.ops.cuda import attention

    def force(kernel, tile=None):
        monkeypatch.setattr(attention, "PREFILL_KERNEL", kernel)
        monkeypatch.setattr(attention, "PREFILL_MMA_TILE", tile and MmaTile(*tile))
    return force


@pytest.mark.parametrize("smem", [227 * 1024, 48 * 1024])
@pytest.mark.parametrize("dtype,d,hq,hkv,bs,qlens,slens", PREFILL)
def test_prefill_attention(emulated, prefill_kernel, smem, dtype, d, hq, hkv, bs, qlens, slens):
    """The CUDA-core (fma) kernel, forced: it is the fallback for float32 and odd head dims."""
    prefill_kernel("fma")
    emulated.info = emulated.info._replace(max_smem_per_block=smem)
    try:
        cases.check_paged_attention("cpu", dtype, qlens, slens, num_q_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, block_size=bs)
    finally:
        emulated.info = emulated.info._replace(max_smem_per_block=227 * 1024)
    assert emulated.launches[0][0] == "paged_prefill_kernel"


# Tensor-core prefill (attention_prefill_mma.cu): mma.sync / ldmatrix / cp.async run on the
# emulator's warp-collective model. (dtype, head_dim, Hq, Hkv, block_size, query_lens,
# seq_lens, (BLOCK_M, BLOCK_N, NUM_WARPS)). Each tile shape and head dim is one more g++
# build (~2 s on 2 cores), so the cases share them where they can.
PREFILL_MMA = [
    # fresh prompt, a decode row, a chunk over a cached prefix; 32-row warps (Q from smem)
    (torch.bfloat16, 128, 8, 2, 16, [37, 1, 20], [37, 45, 100], (128, 64, 4)),
    # MHA, fp16, several key tiles, 16-row warps with Q fragments in registers
    (torch.float16, 64, 2, 2, 32, [70, 5], [70, 133], (64, 32, 4)),
    # GQA 7: rows straddle tokens and warps; KV block (64) larger than the key tile
    (torch.bfloat16, 64, 7, 1, 64, [10, 3, 2], [30, 3, 90], (64, 32, 4)),
    # head 96, 8 warps, GQA 3
    (torch.float16, 96, 6, 2, 16, [20, 9], [20, 50], (128, 64, 8)),
    # head 256: 16-row warps re-read Q from smem
    (torch.bfloat16, 256, 4, 2, 16, [17, 2], [40, 2], (64, 32, 4)),
    # head 80 (not a power of two), 2 warps, 16-key tiles
    (torch.bfloat16, 80, 4, 4, 16, [9, 30], [25, 30], (32, 16, 2)),
]


def _mma_id(case):
    dtype, d, hq, hkv, bs, qlens, slens, tile = case
    return f"{str(dtype)[6:]}-d{d}-g{hq // hkv}-bs{bs}-{'x'.join(map(str, tile))}"


@pytest.mark.parametrize("case", PREFILL_MMA, ids=_mma_id)
def test_prefill_attention_mma(emulated, prefill_kernel, case):
    dtype, d, hq, hkv, bs, qlens, slens, tile = case
    prefill_kernel("mma", tile)
    cases.check_paged_attention("cpu", dtype, qlens, slens, num_q_heads=hq, num_kv_heads=hkv,
                                head_dim=d, block_size=bs, seed=1)
    name, grid, block, smem = emulated.launches[0]
    assert name == "paged_prefill_mma_kernel" and block == (32 * tile[2], 1, 1)
    assert smem == prefill_mma_smem_bytes(tile[0], tile[1], d)


@pytest.mark.parametrize("smem", [227 * 1024, 48 * 1024])
def test_prefill_auto_takes_mma_for_half_types(emulated, prefill_kernel, smem):
    """Auto dispatch: bf16/fp16 with head_dim % 16 == 0 take the mma kernel, with the plan's
    tile (the 48 KiB plan included); float32 takes the fma kernel."""
    prefill_kernel("auto")
    emulated.info = emulated.info._replace(max_smem_per_block=smem)
    try:
        cases.check_paged_attention("cpu", torch.bfloat16, [33, 4], [33, 60], num_q_heads=4,
                                    num_kv_heads=1, head_dim=64, block_size=16)
        name, _, _, used = emulated.launches[-1]
        assert name == "paged_prefill_mma_kernel" and used <= smem
        cases.check_paged_attention("cpu", torch.float32, [5], [9], num_q_heads=2,
                                    num_kv_heads=1, head_dim=64, block_size=16)
        assert emulated.launches[-1][0] == "paged_prefill_kernel"
    finally:
        emulated.info = emulated.info._replace(max_smem_per_block=227 * 1024)


def test_prefill_kernel_switch(emulated, prefill_kernel, monkeypatch):
    from heron.core.ops.cuda import attention

    prefill_kernel(None)
    monkeypatch.delenv("HERON_PREFILL_KERNEL", raising=False)
    assert attention.prefill_kernel_choice() == "auto"
    monkeypatch.setenv("HERON_PREFILL_KERNEL", "fma")
    assert attention.prefill_kernel_choice() == "fma"
    monkeypatch.setenv("HERON_PREFILL_KERNEL", "bogus")
    with pytest.raises(ValueError, match="fma, mma or auto"):
        attention.prefill_kernel_choice()
    monkeypatch.setenv("HERON_PREFILL_KERNEL", "mma")
    with pytest.raises(ValueError, match="mma prefill kernel takes"):  # float32: no mma path
        cases.check_paged_attention("cpu", torch.float32, [5], [9], num_q_heads=2,
                                    num_kv_heads=1, head_dim=64, block_size=16)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("max_smem", [48 * 1024, 99 * 1024, 227 * 1024])
def test_prefill_mma_plan(head_dim, max_smem):
    try:
        tile = plan_prefill_mma(head_dim, max_smem)
    except ValueError:
        assert head_dim > 128 and max_smem == 48 * 1024  # only head 256 needs the opt-in
        return
    assert prefill_mma_smem_bytes(tile.block_m, tile.block_n, head_dim) <= max_smem
    assert tile.block_m // tile.num_warps in (16, 32) and tile.block_n % 16 == 0
    if max_smem >= 99 * 1024 and head_dim <= 128:
        assert tile == MmaTile(128, 64, 4)
    # a small grid gets the smallest fitting tile; a big one the best
    assert plan_prefill_mma(head_dim, max_smem, 16, 1, 132).block_m <= tile.block_m
    assert plan_prefill_mma(head_dim, max_smem, 16384, 8, 132) == tile


@pytest.mark.parametrize("seq_lens,bound", [((300, 1, 77), 512), ((40, 1, 17), 64)])
def test_decode_padded_rows(emulated, seq_lens, bound):
    cases.check_decode_padded_rows("cpu", torch.float32, seq_lens, bound)


HEAVY = pytest.mark.skipif(not os.environ.get("HERON_EMULATOR_HEAVY"),
                           reason="minutes on 2 cores: set HERON_EMULATOR_HEAVY=1")


@HEAVY
@pytest.mark.parametrize("tile", [(128, 64, 4), (128, 64, 8), (64, 64, 4), (64, 32, 4)])
def test_prefill_attention_mma_heavy(emulated, prefill_kernel, tile):
    """Llama-3 attention shapes (GQA 4, head 128), a few hundred tokens: many row and key
    tiles per sequence, heavy-first tile order, one chunk over a long cached prefix."""
    prefill_kernel("mma", tile)
    cases.check_paged_attention("cpu", torch.bfloat16, [300, 1, 100], [300, 500, 700],
                                num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                                seed=2)
    cases.check_paged_attention("cpu", torch.float16, [129], [129], num_q_heads=4,
                                num_kv_heads=1, head_dim=128, block_size=32, seed=3)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: per-head q/k norms too
def test_transformer_engine_through_the_kernels(emulated, kind, tmp_path, monkeypatch):
    """The transformer family with every op on its kernel (RMSNorms, SiLU-and-mul, rotary
    with the KV write, paged prefill over a cached prefix and decode): the logits of a whole
    engine run, chunked prefills and mixed batches included, equal those of the torch ops."""
    from heron.core.ops import cuda as cuda_ops
    from heron.plugins.transformer import model
    from tests.tiny_models import build_tiny

    build_tiny(kind, tmp_path, head_dim=32)  # the float32 prefill kernel takes head_dim % 32
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 21, 12)]
    _, ref_tokens, ref_rows, _ = _greedy_run(tmp_path, prompts, 5)
    for name in ("rms_norm", "silu_and_mul", "rotary_write_kv", "paged_attention"):
        monkeypatch.setattr(model, name, getattr(cuda_ops, name))
    _, tokens, rows, outs = _greedy_run(tmp_path, prompts, 5)
    assert {"rms_norm_kernel", "silu_and_mul_kernel", "rotary_kernel", "paged_prefill_kernel",
            "paged_decode_kernel"} <= {name for name, *_ in emulated.launches}
    assert tokens == ref_tokens
    _assert_same_logits(rows, ref_rows, outs, prompts, 5)


def _greedy_run(path, prompts, max_tokens):
    """An engine over ``path`` (prefills chunked at 16 tokens) generating greedily for
    ``prompts``: the engine, the tokens, every logits row by (request, position), outputs."""
    from heron.core.sampling_params import SamplingParams
    from tests.engine_utils import LogitsRecorder, make_engine

    engine = make_engine(path, **{"engine.max_num_batched_tokens": 16})
    recorder = LogitsRecorder(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True, prompt_logprobs=0))
    return engine, [o.outputs[0].token_ids for o in outs], recorder.rows, outs


def _assert_same_logits(rows, ref_rows, outs, prompts, max_tokens) -> None:
    worst = max((rows[(o.request_id, pos)] - ref_rows[(o.request_id, pos)]).abs().max().item()
                for o, p in zip(outs, prompts) for pos in range(len(p) + max_tokens - 1))
    assert worst <= 1e-4, f"kernel vs torch logits differ by {worst:.2e}"


# ---------------------------------------------------------------------------- decode variants
# Non-default decode plans (tests/gpu/decode_cases.py: tensor-core and CUDA-core kernels with
# other warps, rows in flight, prefetch, partitions) and the default one, over padded graph
# rows (seq_len 0), GQA 1/4/8/16, head dims 64/128, block sizes 16/32 and a 4k context split
# over many partitions. (dtype, head_dim, Hq, Hkv, block_size, seq_lens, bound)
DECODE_VARIANT_CASES = [
    (torch.bfloat16, 128, 8, 2, 16, [1, 17, 0, 300, 1000], 1024),   # GQA 4, a padded row
    (torch.float16, 64, 8, 1, 32, [5, 70, 260], 512),               # GQA 8, block 32
    (torch.bfloat16, 64, 2, 2, 16, [33, 0, 129], 256),              # MHA
    (torch.float16, 128, 16, 1, 16, [100, 250], 512),               # GQA 16: both mma row halves
    (torch.bfloat16, 128, 4, 1, 32, [4096], 4096),                  # batch 1, 4k, many splits
    (torch.float32, 64, 4, 2, 16, [1, 0, 70, 300], 300),            # float32: CUDA cores only
]


def _decode_case_id(case):
    dtype, d, hq, hkv, bs, slens, bound = case
    return f"{str(dtype)[6:]}-d{d}-g{hq // hkv}-bs{bs}-b{len(slens)}-max{bound}"


@pytest.mark.parametrize("case", DECODE_VARIANT_CASES, ids=_decode_case_id)
@pytest.mark.parametrize("name", ["default", *decode_cases.DECODE_CONFIGS])
def test_decode_variants(emulated, name, case):
    from heron.core.ops.cuda import plan

    config = decode_cases.DECODE_CONFIGS.get(name, {})
    dtype, d, hq, hkv, bs, slens, bound = case
    if not decode_cases.supported(config, dtype, d, hq // hkv):
        pytest.skip("the tensor-core kernel takes float16/bfloat16 only")
    with plan.decode_config(**config):
        decode_cases.check_decode("cpu", dtype, slens, num_q_heads=hq, num_kv_heads=hkv,
                                  head_dim=d, block_size=bs, max_seq_len=bound, seed=len(slens))
    expected = decode_cases.expected_plan(config, dtype, slens, hq, hkv, d, bound,
                                          emulated.info.num_sms)
    name, grid, block, _ = emulated.launches[0]
    assert name == "paged_decode_kernel"
    assert grid == (expected.max_splits, hkv, len(slens)) and block == (expected.threads, 1, 1)
    reduces = [launch for launch in emulated.launches if launch[0] == "paged_decode_reduce_kernel"]
    assert len(reduces) == (expected.max_splits > 1)


def test_decode_graph_shape_ignores_lengths(emulated):
    """The launch shapes depend on the bound only: same grids for any lengths under it."""
    from heron.core.ops.cuda import plan

    shapes = []
    for slens in ([1, 2], [700, 1024], [0, 513]):
        emulated.launches.clear()
        with plan.decode_config(kernel="mma"):
            decode_cases.check_decode("cpu", torch.bfloat16, slens, num_q_heads=4,
                                      num_kv_heads=1, head_dim=64, block_size=16, max_seq_len=1024)
        shapes.append([launch[:3] for launch in emulated.launches])
    assert shapes[0] == shapes[1] == shapes[2]


def test_prefill_refuses_head_dims_its_kernel_cannot_take(emulated, prefill_kernel):
    prefill_kernel("fma")
    with pytest.raises(ValueError, match="multiple of 32"):
        cases.check_paged_attention("cpu", torch.float32, [5], [9], num_q_heads=2,
                                    num_kv_heads=1, head_dim=16, block_size=16)


# ---------------------------------------------------------------------------- Mamba2
# (the hybrid_ssm family's kernels; small shapes, as every CUDA thread is a real thread)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,width", [([5, 70, 1], 4), ([2], 4), ([9, 3], 2)])
def test_conv1d_prefill(emulated, dtype, seq_lens, width):
    mamba_cases.check_conv1d_prefill("cpu", dtype, seq_lens, 40, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,with_bias,padded", [(4, True, False), (2, False, True)])
def test_conv1d_decode(emulated, dtype, width, with_bias, padded):
    mamba_cases.check_conv1d_decode("cpu", dtype, 3, 150, width, with_bias, padded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,chunk_size", [([7, 40], 16), ([1, 16, 17], 16),
                                                   ([33], 32)])
def test_ssd_prefill(emulated, dtype, seq_lens, chunk_size):
    mamba_cases.check_ssd_prefill("cpu", dtype, seq_lens, 4, 8, 2, 16, chunk_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,state_size,padded", [(2, 16, False), (1, 40, True)])
def test_ssm_decode(emulated, dtype, groups, state_size, padded):
    mamba_cases.check_ssm_decode("cpu", dtype, 3, 4, 8, groups, state_size, padded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate,with_weight", [(False, True), (True, True),
                                                          (False, False)])
def test_gated_rms_norm(emulated, dtype, norm_before_gate, with_weight):
    mamba_cases.check_gated_rms_norm("cpu", dtype, 3, 96, 48, norm_before_gate, with_weight)


@pytest.mark.parametrize("kind", ["bamba", "nemotron_h"])
def test_hybrid_engine_through_the_mamba_kernels(emulated, kind, tmp_path, monkeypatch):
    """The mixer's plumbing (column views, slots, mixed prefill and decode rows, chunked
    prefills) with every Mamba2 op on its kernel: the logits of a whole engine run equal
    those of the torch ops."""
    from heron.plugins.hybrid_ssm import cuda as mamba_cuda
    from heron.plugins.hybrid_ssm import mixer
    from tests.hybrid_models import build_hybrid

    build_hybrid(kind, tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 19, 30)]
    engine, ref_tokens, ref_rows, _ = _greedy_run(tmp_path, prompts, 6)
    assert engine.states.slots.num_used == 0
    names = ("conv1d_prefill", "conv1d_decode", "ssd_prefill", "ssm_decode", "gated_rms_norm")
    for name in names:
        monkeypatch.setattr(mixer, name, getattr(mamba_cuda, name))
    engine, tokens, rows, outs = _greedy_run(tmp_path, prompts, 6)
    assert engine.states.slots.num_used == 0
    launched = {name for name, *_ in emulated.launches}
    assert {"conv1d_prefill_kernel", "ssd_chunk_scan_kernel", "ssm_decode_kernel",
            "gated_rms_norm_kernel"} <= launched
    assert tokens == ref_tokens
    _assert_same_logits(rows, ref_rows, outs, prompts, 6)


# ---------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank,segments", [(8, [(2, 0, 3), (0, 4, 6)]), (5, [(1, 0, 7)])])
def test_lora(emulated, dtype, rank, segments):
    cases.check_lora("cpu", dtype, 7, 72, 100, rank, 3, segments)


def test_lora_engine_through_the_kernels(emulated, tmp_path, monkeypatch):
    """Adapters served by the per-row kernels (the CUDA path of `layer_loras`) in a whole
    engine run: two adapters and the base model in one batch, logits equal to the torch
    path's."""
    from heron.core.ops import lora as lora_ops
    from heron.core.sampling_params import SamplingParams
    from tests.engine_utils import LogitsRecorder, make_engine
    from tests.lora_models import build_standard_adapters
    from tests.tiny_models import build_tiny

    model = build_tiny("llama", tmp_path / "base")
    adapters = build_standard_adapters(model, tmp_path)
    names = list(adapters)[:2]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 13, 9)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)

    def run():
        engine = make_engine(tmp_path / "base", **{
            "lora.adapters": {n: str(adapters[n]) for n in names}, "lora.max_loras": 2})
        recorder = LogitsRecorder(engine)
        for i, (prompt, adapter) in enumerate(zip(prompts, [names[0], None, names[1]])):
            engine.add_request(f"r{i}", prompt, params, adapter=adapter)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return recorder.rows, sorted(outs, key=lambda o: o.request_id)

    ref_rows, _ = run()
    monkeypatch.setattr(lora_ops, "runs_per_row", lambda weights: True)
    rows, outs = run()
    assert {"lora_shrink_kernel", "lora_expand_kernel"} <= {n for n, *_ in emulated.launches}
    _assert_same_logits(rows, ref_rows, outs, prompts, 4)
