"""The compiled CPU prompt attention (``heron_prefill_attention`` in
``core/ops/kernels/paged_attention_cpu.cpp``) against attention written out in float64.

The caches' unowned slots hold NaN (the tail of a sequence's last block included), so a key
read outside a sequence's context, or past a query's causal limit, shows up in its output.
"""

from __future__ import annotations

import pytest
import torch

import heron.core.ops.attention as attention
from heron.core.ops import paged_attention_ref
from tests.gpu.cases import make_paged_case
from tests.kernel_utils import vector_widths
from tests.test_paged_attention import written_out


def prompt_case(query_lens, seq_lens, *, num_q_heads=9, num_kv_heads=3, head_dim=64,
                block_size=16, dtype=torch.float32, seed=0):
    case = make_paged_case(query_lens, seq_lens, num_q_heads=num_q_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                           dtype=dtype, device="cpu", seed=seed)
    case.meta.cpu_kernels = True
    return case


def on_one_and_on_several_threads(run):
    """``(run(), run())``: torch (whose OpenMP pool the kernels share) on one thread, then on
    several."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        return one, run()
    finally:
        torch.set_num_threads(threads)


vector_width = vector_widths(attention, "_kernels")


def compiled(case) -> torch.Tensor:
    out = attention._compiled_prefill(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out is not None, "the compiled prompt kernel did not run (is a C++ compiler there?)"
    return out


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([2, 5], [2, 5]),                  # whole prompts shorter than a tile of keys
    ([300], [300]),                    # a whole prompt: several tiles of queries and keys
    ([77], [1100]),                    # a chunk after a cached prefix
    ([17, 3, 40, 64], [17, 50, 200, 64]),
    ([2, 22, 7], [9, 40, 7]),          # short chunks: tiles of padding rows
])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),    # SmolLM2-135M's shape
    (6, 2, 32, 4),
    (4, 4, 16, 1),     # no grouping; one key a block
    (16, 2, 128, 8),   # a group of 8
    (5, 1, 48, 16),    # a group of 5: tiles whose rows do not fill whole blocks of 8
])
def test_compiled_prefill_matches_attention_written_out(query_lens, seq_lens, num_q_heads,
                                                        num_kv_heads, head_dim, block_size,
                                                        vector_width):
    case = prompt_case(query_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size)
    out = compiled(case)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


def test_decode_rows_beside_prompts_go_to_the_decode_kernel(monkeypatch):
    """One call: the prompt kernel skips the one-query sequences, the decode kernel takes
    them, and every row comes out right."""
    calls = []
    real = attention._compiled_decode
    monkeypatch.setattr(attention, "_compiled_decode", lambda *a: calls.append(a[0].shape[0])
                        or real(*a))
    case = prompt_case([1, 90, 1, 1, 33], [50, 90, 9, 700, 100], seed=3)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [3]
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logit_scale", [30.0, 1e-3])
def test_peaked_and_flat_softmax(logit_scale):
    """Logits hundreds apart (the running max moves often, old sums rescale to nothing)
    and logits all but equal. Logits of ~100 carry float32 rounding of ~1e-5 into the
    output whoever computes them, so the bound is torch's own SDPA's error, or 1e-5."""
    case = prompt_case([120, 9], [400, 9], seed=4)
    case.q *= logit_scale
    exact = written_out(case)
    error = (compiled(case).double() - exact).abs().max()
    case.meta.cpu_kernels = False
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    torch_ops = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert error <= max(1e-5, 1.5 * (torch_ops.double() - exact).abs().max())


def test_the_same_output_on_any_number_of_threads():
    """Tasks race for threads, but each writes only its own rows: bit for bit the same."""
    case = prompt_case([200, 1, 64], [500, 30, 64], seed=5)
    one, several = on_one_and_on_several_threads(lambda: compiled(case))
    assert torch.equal(one, several)


def test_a_bfloat16_cache():
    """Keys and values widen to float32 as they load; the output rounds to bfloat16 once."""
    case = prompt_case([70, 5], [300, 5], dtype=torch.bfloat16, seed=8)
    out = compiled(case)
    assert out.dtype == torch.bfloat16
    exact = written_out(case)  # in float64 from the same bfloat16 values
    rounding = (exact.bfloat16().double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= 2 * rounding


def test_the_engine_path_takes_it_and_the_torch_ops_agree(monkeypatch):
    """`paged_attention_ref` with the kernels asked for runs this one; without, the torch
    ops; both match attention written out."""
    calls = []
    real = attention._compiled_prefill
    monkeypatch.setattr(attention, "_compiled_prefill", lambda *a: calls.append(1) or real(*a))
    case = prompt_case([40, 3, 25], [40, 60, 90], seed=6)
    with_kernel = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1]
    case.meta.cpu_kernels = False
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    torch_ops = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1]
    for out in (with_kernel, torch_ops):
        torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


def test_where_it_does_not_apply_the_torch_ops_serve():
    case = prompt_case([9, 4], [9, 30], num_q_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=4, dtype=torch.float16)
    assert attention._compiled_prefill(case.q, case.k_cache, case.v_cache, case.meta,
                                       case.scale) is None
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), written_out(case), rtol=2e-2, atol=2e-2)
