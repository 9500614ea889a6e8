"""The compiled CPU SiLU-and-mul (``core/ops/kernels/activation_cpu.cpp``) against SiLU
written out in float64, and against the torch ops it replaces, `silu_and_mul_ref`."""

from __future__ import annotations

import pytest
import torch

import heron.core.ops.activation as activation
from heron.core.ops.activation import silu_and_mul, silu_and_mul_ref
from tests.kernel_utils import vector_widths

vector_width = vector_widths(activation, "_kernel")


def written_out(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def compiled(x):
    out = activation._compiled_silu_and_mul(x)
    assert out is not None, "the compiled SiLU-and-mul did not run (is a C++ compiler there?)"
    return out


@pytest.mark.parametrize("rows, d", [(1, 1536), (7, 64), (300, 576), (5, 100), (2, 3)])
def test_compiled_silu_and_mul_matches_silu_written_out(rows, d, vector_width):
    """Row counts on one thread and on several (300 x 576), widths that are not whole
    vectors (100, 3); gates far into both tails, where exp(-g) would overflow a float32."""
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, 2 * d, generator=g) * 4
    x[0, :3] = torch.tensor([-200.0, 150.0, 0.0])
    x_in = x.clone()
    out = compiled(x)
    assert out.shape == (rows, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), written_out(x), rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-6, atol=1e-30)
    assert torch.equal(x, x_in)
    # silu(-200) is -200 exp(-200): 0 in float32, and below 1e-30 here (the exp stops at -87)
    assert out[0, 0].abs() < 1e-30 and out[0, 2] == 0


def test_rows_of_a_wider_tensor_are_read_in_place():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 300, generator=g)
    x = wide[:, 10:138]
    torch.testing.assert_close(compiled(x).double(), written_out(x), rtol=1e-6, atol=1e-30)


def test_bfloat16_rounds_where_the_torch_ops_do(vector_width):
    """silu(gate) rounds to bfloat16 before the product: torch's bits but where the float32
    sigmoid, another exp, lands on the other side of a rounding boundary (one step)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 2 * 576, generator=g) * 3).bfloat16()
    out, ref = compiled(x), silu_and_mul_ref(x)
    assert out.dtype == torch.bfloat16
    assert (out != ref).float().mean() < 0.01
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-30)


def test_silu_and_mul_takes_the_kernel_for_float32_and_bfloat16_and_torch_otherwise(
        monkeypatch):
    calls = []
    real = activation._compiled_silu_and_mul
    monkeypatch.setattr(activation, "_compiled_silu_and_mul",
                        lambda x: calls.append(x.dtype) or real(x))
    x = torch.randn(4, 64)
    out = silu_and_mul(x)
    silu_and_mul(x.bfloat16())
    assert calls == [torch.float32, torch.bfloat16]
    torch.testing.assert_close(out.double(), written_out(x), rtol=1e-6, atol=1e-30)
    for other in (x.half(), x.view(2, 2, 64), x[:, ::2], torch.randn(3, 5)):
        assert real(other) is None  # float16, 3-d, strided elements, an odd width
    for other in (x.half(), x.view(2, 2, 64), x[:, ::2]):
        torch.testing.assert_close(silu_and_mul(other), silu_and_mul_ref(other))
    assert silu_and_mul(torch.empty(0, 64)).shape == (0, 32)
