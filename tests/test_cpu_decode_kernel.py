"""The compiled CPU decode attention (``core/ops/kernels/paged_attention_cpu.cpp``) against
attention written out in float64, and its loader (`heron.core.cpu_kernels`).

The caches' unowned slots hold NaN (the tail of a sequence's last block included), so a key
read outside a sequence's context shows up in its output.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import heron.core.ops.attention as attention
from heron.core import cpu_kernels
from heron.core.ops import paged_attention_ref
from tests.gpu.cases import make_paged_case
from tests.kernel_utils import vector_widths
from tests.test_cpu_prefill_kernel import on_one_and_on_several_threads, prompt_case
from tests.test_paged_attention import share_blocks, written_out


vector_width = vector_widths(attention, "_kernels")


def decode_case(seq_lens, *, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4, seed=0):
    return prompt_case([1] * len(seq_lens), seq_lens, num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                       seed=seed)


def compiled(case) -> torch.Tensor:
    out = attention._compiled_decode(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out is not None, "the compiled decode kernel did not run (is a C++ compiler there?)"
    return out


@pytest.mark.parametrize("seq_lens", [
    [1],                       # one key
    [5, 17, 9],
    [64, 3, 1, 100, 33],       # block boundaries, a single key among longer contexts
    [700],                     # one sequence, several tasks
])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [
    (6, 2, 32, 4),
    (9, 3, 64, 16),    # SmolLM2-135M's shape
    (4, 4, 16, 1),     # no grouping; one key a block
    (16, 2, 128, 8),   # a group of 8
])
def test_compiled_decode_matches_attention_written_out(seq_lens, num_q_heads, num_kv_heads,
                                                       head_dim, block_size, vector_width,
                                                       monkeypatch):
    # tasks of a few keys: most sequences split in several, merged by their log-sum-exps
    monkeypatch.setattr(attention, "PART_KEYS_MIN", 7)
    monkeypatch.setattr(attention, "PART_KEYS_MAX", 7)
    case = decode_case(seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size)
    out = compiled(case)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("part_keys", [16, 100, 2048])
def test_a_long_context_whole_or_in_parts(part_keys, monkeypatch):
    monkeypatch.setattr(attention, "PART_KEYS_MIN", part_keys)
    monkeypatch.setattr(attention, "PART_KEYS_MAX", part_keys)
    case = decode_case([3000, 1500, 2], num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=16, seed=2)
    torch.testing.assert_close(compiled(case).double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logit_scale", [30.0, 1e-3])
def test_peaked_and_flat_softmax(logit_scale):
    """Logits hundreds apart (weights that underflow to nothing beside the largest) and
    logits all but equal."""
    case = decode_case([40, 333, 7], head_dim=64, block_size=16, seed=4)
    case.q *= logit_scale
    torch.testing.assert_close(compiled(case).double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_len", [64, 29])  # whole vectors of scores; a tail after them
def test_the_softmax_weights_to_float_rounding(seq_len):
    """With logits exact in float32 (key t is c_t e_0 with c_t a small integer, the query
    is e_0, the scale 1/8) and key t's value the unit vector e_t, the output is the weights
    themselves, each within a few roundings of float64's though they span six decades."""
    case = decode_case([seq_len], num_q_heads=1, num_kv_heads=1, head_dim=64, block_size=16)
    blocks = case.meta.block_tables[0, :-(-seq_len // 16)].long()
    keys, values = torch.zeros(2, len(blocks) * 16, 64)
    keys[:seq_len, 0] = (torch.arange(seq_len) * 37 % 121 - 60).float()  # logits -7.5..7.5
    values[:seq_len] = torch.eye(64)[:seq_len]
    case.k_cache[blocks] = keys.view(-1, 16, 1, 64)
    case.v_cache[blocks] = values.view(-1, 16, 1, 64)
    case.q.zero_()[:, :, 0] = 1.0
    weights = compiled(case)[0, 0, :seq_len].double()
    expected = written_out(case)[0, 0, :seq_len]
    assert expected.min() < 1e-5 * expected.max()
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)


def test_the_same_output_on_any_number_of_threads(monkeypatch):
    """Tasks race for threads, but each writes its own part and the merge runs in order:
    with the same split of keys into tasks, the output is bit for bit the same."""
    monkeypatch.setattr(attention, "PART_KEYS_MIN", 128)
    monkeypatch.setattr(attention, "PART_KEYS_MAX", 128)
    case = decode_case([900, 33, 1, 250], num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=16, seed=5)
    one, several = on_one_and_on_several_threads(lambda: compiled(case))
    assert torch.equal(one, several)


def test_the_engine_path_takes_it_for_a_shared_prefix_too(monkeypatch):
    """With the kernel on, `paged_attention_ref` decodes through it even where sequences
    share a prefix (the torch path would split that out), with the same result."""
    monkeypatch.setattr("heron.core.batch.MIN_SHARED_KEYS", 1)
    case = share_blocks(decode_case([20, 17, 30, 13], block_size=4, seed=6), [0, 1, 2, 3], 3)
    calls = []
    real = attention._compiled_decode
    monkeypatch.setattr(attention, "_compiled_decode",
                        lambda *a: calls.append(1) or real(*a))
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1]
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)
    # the decode rows beside a prompt chunk take it as well
    case = make_paged_case([1, 90, 1], [50, 90, 9], num_q_heads=6, num_kv_heads=2,
                           head_dim=32, block_size=4, dtype=torch.float32, device="cpu")
    case.meta.cpu_kernels = True
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1, 1]
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens", [[5, 17, 9], [700, 1]])
def test_a_bfloat16_cache(seq_lens):
    """Keys and values widen to float32 as they load; the output rounds to bfloat16 once."""
    case = make_paged_case([1] * len(seq_lens), seq_lens, num_q_heads=9, num_kv_heads=3,
                           head_dim=64, block_size=16, dtype=torch.bfloat16, device="cpu",
                           seed=8)
    case.meta.cpu_kernels = True
    out = compiled(case)
    assert out.dtype == torch.bfloat16
    exact = written_out(case)  # in float64 from the same bfloat16 values
    torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=1e-3)
    # rounding once: as close as the exact result rounded to bfloat16, give or take an ulp
    rounding = (exact.bfloat16().double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= 2 * rounding


def test_where_it_does_not_apply_the_torch_ops_serve():
    assert attention.compiled_attention_applies(torch.float32, 64)
    assert attention.compiled_attention_applies(torch.bfloat16, 64)
    assert not attention.compiled_attention_applies(torch.float16, 64)
    assert not attention.compiled_attention_applies(torch.float32, 24)  # not whole vectors
    case = make_paged_case([1, 1], [9, 30], num_q_heads=4, num_kv_heads=2, head_dim=32,
                           block_size=4, dtype=torch.float16, device="cpu")
    case.meta.cpu_kernels = True
    assert attention._compiled_decode(case.q, case.k_cache, case.v_cache, case.meta,
                                      case.scale) is None
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), written_out(case), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------- the loader


@pytest.fixture
def fresh_loader(tmp_path, monkeypatch):
    """An empty kernel cache and no libraries loaded yet in this process."""
    monkeypatch.setenv("HERON_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_LIBRARIES", {})
    return tmp_path


def test_a_build_is_cached_on_disk_and_in_the_process(fresh_loader):
    lib = cpu_kernels.load("paged_attention_cpu.cpp", {"HEAD_DIM": 32})
    assert lib is not None and cpu_kernels.load("paged_attention_cpu.cpp",
                                                {"HEAD_DIM": 32}) is lib
    (built,) = fresh_loader.iterdir()
    assert built.name.startswith("paged_attention_cpu-") and built.suffix == ".so"
    stamp = built.stat().st_mtime_ns
    cpu_kernels._LIBRARIES.clear()  # a new process: the file is loaded, not built again
    assert cpu_kernels.load("paged_attention_cpu.cpp", {"HEAD_DIM": 32}) is not None
    assert [p.name for p in fresh_loader.iterdir()] == [built.name]
    assert built.stat().st_mtime_ns == stamp
    assert cpu_kernels.load("paged_attention_cpu.cpp", {"HEAD_DIM": 64}) is not None
    assert len(list(fresh_loader.iterdir())) == 2  # another define set, another library


def test_a_changed_header_builds_anew(fresh_loader, tmp_path_factory, monkeypatch):
    """A library's name hashes the headers beside its source too, so editing a shared
    header rebuilds the kernels that include it rather than loading a stale build."""
    sources = tmp_path_factory.mktemp("kernels")
    for f in ("norm_cpu.cpp", *(h.name for h in cpu_kernels.KERNEL_DIR.glob("*.h"))):
        shutil.copy(cpu_kernels.KERNEL_DIR / f, sources / f)
    monkeypatch.setattr(cpu_kernels, "KERNEL_DIR", sources)
    assert cpu_kernels.load("norm_cpu.cpp") is not None
    cpu_kernels._LIBRARIES.clear()
    with (sources / "vec_cpu.h").open("a") as header:
        header.write("// edited\n")
    assert cpu_kernels.load("norm_cpu.cpp") is not None
    assert len(list(fresh_loader.iterdir())) == 2


def test_no_compiler_means_the_torch_ops(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CXX", os.fspath(fresh_loader / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="heron.core.cpu_kernels"):
        assert cpu_kernels.load("paged_attention_cpu.cpp", {"HEAD_DIM": 32}) is None
    assert "torch ops instead" in caplog.text
    assert list(fresh_loader.iterdir()) == []


def test_a_failed_build_says_why_and_leaves_nothing(fresh_loader, caplog):
    with caplog.at_level(logging.WARNING, logger="heron.core.cpu_kernels"):
        assert cpu_kernels.load("paged_attention_cpu.cpp", {"HEAD_DIM": 24}) is None
    assert "HEAD_DIM must be a multiple of 16" in caplog.text
    assert list(fresh_loader.iterdir()) == []  # no half-written library
