"""The compiled CPU RMSNorm (``core/ops/kernels/norm_cpu.cpp``) against RMSNorm written out in
float64, and the compiled rotary-with-KV-write (``rotary_cpu.cpp``) against the torch ops it
replaces, `rotary_write_kv_ref`, bit for bit; an engine with these kernels (and SiLU-and-mul's)
against one without."""

from __future__ import annotations

import pytest
import torch

import heron.core.ops.activation as activation
import heron.core.ops.attention as attention
import heron.core.ops.norm as norm
from heron.core.ops import rms_norm, rms_norm_ref, rope_cos_sin_cache, rotary_write_kv
from heron.core.ops.attention import rotary_write_kv_ref
from tests.kernel_utils import vector_widths


def written_out_norm(x, weight, eps, residual=None):
    s = x.double() if residual is None else x.double() + residual.double()
    return s * (s.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight.double()


def compiled_norm(x, weight, eps, residual=None):
    out = norm._compiled_rms_norm(x, weight, eps, residual)
    assert out is not None, "the compiled RMSNorm did not run (is a C++ compiler there?)"
    return out


vector_width = vector_widths(norm, "_norm_kernel")


@pytest.mark.parametrize("rows, n", [(1, 576), (7, 64), (300, 576), (5, 100), (2, 8)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_compiled_rms_norm_matches_rms_norm_written_out(rows, n, with_residual, vector_width):
    """Row counts on one thread and on several (300 x 576), widths that are not whole
    vectors of 16 (100, 8); the summed residual is torch's ``x + residual`` exactly."""
    g = torch.Generator().manual_seed(rows * n)
    x, weight = torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g) if with_residual else None
    x_in, residual_in = x.clone(), None if residual is None else residual.clone()
    out, summed = compiled_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out.double(), written_out_norm(x, weight, 1e-5, residual),
                               rtol=2e-6, atol=2e-6)
    if with_residual:
        assert torch.equal(summed, x + residual)
    else:
        assert summed is None
    # the inputs stay as they were: a caller may norm the same pair twice (hidden-state taps)
    assert torch.equal(x, x_in) and (residual is None or torch.equal(residual, residual_in))


def test_rows_of_a_wider_tensor_and_heads_of_a_contiguous_one():
    """Strided rows (a slice of a wider tensor) are read in place; a contiguous ``[T, H, D]``
    normalizes each head's row; rows whose heads are not evenly spaced (heads of a fused
    projection) are left to the torch ops."""
    g = torch.Generator().manual_seed(1)
    wide, weight = torch.randn(6, 200, generator=g), torch.randn(64, generator=g)
    out, _ = compiled_norm(wide[:, 16:80], weight, 1e-6)
    torch.testing.assert_close(out.double(), written_out_norm(wide[:, 16:80], weight, 1e-6),
                               rtol=2e-6, atol=2e-6)
    heads = torch.randn(3, 4, 64, generator=g)
    out, _ = compiled_norm(heads, weight, 1e-6)
    assert out.shape == heads.shape
    torch.testing.assert_close(out.double(), written_out_norm(heads, weight, 1e-6),
                               rtol=2e-6, atol=2e-6)
    qkv = torch.randn(3, 4 * 64 + 32, generator=g)
    q = qkv[:, :256].view(3, 4, 64)
    assert norm._compiled_rms_norm(q, weight, 1e-6, None) is None
    torch.testing.assert_close(rms_norm(q, weight, 1e-6)[0], rms_norm_ref(q, weight, 1e-6)[0])


@pytest.mark.parametrize("with_residual", [False, True])
def test_a_bfloat16_rms_norm_rounds_where_the_torch_ops_do(with_residual, vector_width):
    """The sum rounds to bfloat16 as torch's add does (exactly), the norm rounds before the
    weight's product: torch's bits but where the float32 norm, summed in another order,
    lands on the other side of a rounding boundary (at most one bfloat16 step)."""
    g = torch.Generator().manual_seed(2)
    x, weight = (torch.randn(300, 576, generator=g) * 3).bfloat16(), torch.randn(576).bfloat16()
    residual = torch.randn(300, 576, generator=g).bfloat16() if with_residual else None
    out, summed = compiled_norm(x, weight, 1e-5, residual)
    ref, ref_summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert out.dtype == torch.bfloat16
    assert summed is None if residual is None else torch.equal(summed, ref_summed)
    assert (out != ref).float().mean() < 0.01
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-30)


def test_rms_norm_takes_the_kernel_for_float32_and_bfloat16_and_torch_for_float16(
        monkeypatch):
    calls = []
    real = norm._compiled_rms_norm
    monkeypatch.setattr(norm, "_compiled_rms_norm", lambda *a: calls.append(a[0].dtype)
                        or real(*a))
    x, weight = torch.randn(4, 32), torch.randn(32)
    out, summed = rms_norm(x, weight, 1e-6, x)
    rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    assert calls == [torch.float32, torch.bfloat16] and summed is not None
    torch.testing.assert_close(out.double(), written_out_norm(x, weight, 1e-6, x),
                               rtol=2e-6, atol=2e-6)
    assert real(x.half(), weight.half(), 1e-6, None) is None
    out, _ = rms_norm(x.half(), weight.half(), 1e-6)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, rms_norm_ref(x.half(), weight.half(), 1e-6)[0])


def rotary_case(num_tokens, *, q_heads=9, kv_heads=3, head_dim=64, rot=None,
                dtype=torch.float32, cache_dtype=torch.float32, seed=0):
    """Views of a fused qkv projection, as the transformer family passes them; caches of
    NaN, each token at its own random slot, every fifth token a padding row (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, q_heads, head_dim)
    k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
    cos_sin = rope_cos_sin_cache(rot or head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    num_blocks, block_size = num_tokens // 4 + 2, 8
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"),
                         dtype=cache_dtype) for _ in range(2)]
    return q, k, v, positions, cos_sin, *caches, slots


def both_ways(case):
    """(q, k_cache, v_cache) of the compiled kernel, then of the torch ops, from one case."""
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = case
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = attention._compiled_rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                              slots)
    assert out is not None, "the compiled rotary did not run (is a C++ compiler there?)"
    ref = rotary_write_kv_ref(q, k, v, positions, cos_sin, k_ref, v_ref, slots)
    return (out, k_cache, v_cache), (ref, k_ref, v_ref)


@pytest.mark.parametrize("num_tokens", [1, 33, 700])  # 700: on several threads
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, rot", [
    (9, 3, 64, None),    # SmolLM2-135M's shape
    (4, 4, 16, None),
    (8, 2, 128, 64),     # half the head rotates (partial rotary), the rest passes through
    (6, 1, 40, 24),      # widths that are not whole vectors
])
@pytest.mark.parametrize("dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16)])
def test_compiled_rotary_write_kv_is_the_torch_ops_bit_for_bit(num_tokens, q_heads, kv_heads,
                                                               head_dim, rot, dtype,
                                                               cache_dtype):
    """The same rotated queries and the same cache contents, NaN where nothing was written
    (padding rows store nothing); bfloat16 results round to nearest even as torch's do."""
    case = rotary_case(num_tokens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       rot=rot, dtype=dtype, cache_dtype=cache_dtype, seed=num_tokens)
    (out, k_cache, v_cache), (ref, k_ref, v_ref) = both_ways(case)
    assert out.shape == ref.shape and out.is_contiguous()
    assert torch.equal(out, ref)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_bfloat16_rounding_at_the_edges():
    """Values halfway between two bfloat16s (ties to even), the largest finite float32
    (rounds to inf), infinities and subnormals: the bits torch's conversion gives."""
    case = list(rotary_case(4, q_heads=1, kv_heads=1, head_dim=16,
                            cache_dtype=torch.bfloat16))
    edges = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4028235e38,
                          float("inf"), float("-inf"), 1e-40, -1e-40, 0.0, -0.0,
                          1 + 2 ** -8 + 2 ** -20, 65504.0, 2 ** -126, 1.0, -2.5, 7.0])
    case[2] = edges.repeat(4, 1, 1)  # v: written without rotation
    case[-1] = torch.arange(4)
    (_, _, v_cache), (_, _, v_ref) = both_ways(case)
    assert torch.equal(v_cache.view(torch.int16), v_ref.view(torch.int16))


def test_rotary_write_kv_takes_the_kernel_where_it_applies(monkeypatch):
    calls = []
    real = attention._compiled_rotary_write_kv
    monkeypatch.setattr(attention, "_compiled_rotary_write_kv",
                        lambda *a: calls.append(1) or real(*a))
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rotary_case(5)
    rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert calls == [1]
    # float16 rows, or bfloat16 rows into a float32 cache: the torch ops
    for dtype in (torch.float16, torch.bfloat16):
        rows = [t.to(dtype) for t in (q, k, v)]
        assert real(*rows, positions, cos_sin, k_cache, v_cache, slots) is None


@pytest.mark.parametrize("field, bad", [("position", 4096), ("position", -1), ("slot", 10**6)])
def test_out_of_bounds_is_an_error_not_a_stray_write(field, bad):
    """A position past the rotary table or a slot past the caches: the kernel touches
    nothing and says so, and the torch ops raise."""
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = rotary_case(6)
    (positions if field == "position" else slots)[3] = bad
    assert attention._compiled_rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                               slots) is None
    assert k_cache.isnan().all() and v_cache.isnan().all()
    with pytest.raises(IndexError):
        rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_with_the_kernels_and_without(dtype, tmp_path, monkeypatch):
    """A tiny Llama served greedily (chunked prefills beside decodes): the kernels run, and
    the logits are the torch ops' (float32 to rounding; bfloat16 to the rare norm a rounding
    step away), the tokens the same."""
    from heron.core.sampling_params import SamplingParams
    from tests.engine_utils import LogitsRecorder, make_engine
    from tests.tiny_models import build_tiny

    build_tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run():
        engine = make_engine(tmp_path, **{"model.dtype": dtype,
                                          "engine.max_num_batched_tokens": 16})
        recorder = LogitsRecorder(engine)
        outs = engine.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], recorder.rows

    kernels = {"_compiled_rms_norm": norm, "_compiled_rotary_write_kv": attention,
               "_compiled_silu_and_mul": activation}
    calls = []
    for name, module in kernels.items():
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    tokens, rows = run()
    assert set(calls) == set(kernels)
    for name, module in kernels.items():
        monkeypatch.setattr(module, name, lambda *a: None)
    ref_tokens, ref_rows = run()
    assert tokens == ref_tokens and rows.keys() == ref_rows.keys()
    worst = max((rows[key].double() - ref_rows[key].double()).abs().max() for key in rows)
    assert worst <= (1e-4 if dtype == "float32" else 0.1), worst
