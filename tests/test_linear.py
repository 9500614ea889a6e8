"""`core/ops/linear`: packed CPU weights give F.linear's result for any row count."""

import pytest
import torch
import torch.nn.functional as F

from heron.core.ops import linear, pack_weight
from heron.core.ops.linear import can_pack


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    packed = pack_weight(w)
    assert can_pack(w) and packed.is_mkldnn  # torch's CPU build ships oneDNN
    assert tuple(packed.shape) == (96, 48)
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for weight in (packed, w):  # the fused ReLU, and the plain weight's
        torch.testing.assert_close(linear(x, weight, b, relu=True), F.relu(F.linear(x, w, b)),
                                   rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_strided_input():
    w = torch.randn(32, 24)
    x = torch.randn(24, 10).t()  # [10, 24], not contiguous
    torch.testing.assert_close(linear(x, pack_weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fp32_and_bf16_cpu_weights_are_packed_other_dtypes_not():
    w = torch.randn(8, 4, dtype=torch.float16)
    assert pack_weight(w) is w
    assert pack_weight(None) is None
    torch.testing.assert_close(linear(torch.ones(2, 4, dtype=torch.float16), w),
                               F.linear(torch.ones(2, 4, dtype=torch.float16), w))
    bf16 = torch.randn(8, 4, dtype=torch.bfloat16)
    assert pack_weight(bf16).is_mkldnn == torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_weight_multiplies_fp32_rows_in_bf16(bias):
    """A weight of another dtype: x is cast to it, the result back to x's dtype."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 48, generator=g).bfloat16()
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(5, 48, generator=g)
    want = F.linear(x.bfloat16(), w, None if b is None else b.bfloat16()).float()
    for weight in (w, pack_weight(w)):
        out = linear(x, weight, b)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
