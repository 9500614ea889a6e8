"""The Mamba2 ops of the hybrid_ssm family: chunked scan vs the one-step recurrence, state
carried across arbitrary splits, gated norms vs transformers' modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.plugins.hybrid_ssm.mamba2 import (causal_conv1d, causal_conv1d_step, gated_rms_norm,
                                             ssd_chunk_scan, ssm_step)

H, P, G, N, C, K = 4, 8, 2, 16, 24, 4


def inputs(num_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=rand(num_tokens, H, P), dt=F.softplus(rand(num_tokens, H)),
                A=-torch.exp(rand(H) * 0.5), B=rand(num_tokens, G, N), C=rand(num_tokens, G, N),
                D=rand(H)), rand(H, P, N)


@pytest.mark.parametrize("num_tokens,chunk_size", [(1, 8), (7, 8), (8, 8), (29, 8), (29, 4)])
def test_chunk_scan_equals_the_recurrence(num_tokens, chunk_size):
    t, state = inputs(num_tokens)
    y, final = ssd_chunk_scan(**t, chunk_size=chunk_size, initial_state=state)
    ys, h = [], state[None]
    for i in range(num_tokens):
        y_i, h = ssm_step(h, t["x"][i:i + 1], t["dt"][i:i + 1], t["A"], t["B"][i:i + 1],
                          t["C"][i:i + 1], t["D"])
        ys.append(y_i)
    torch.testing.assert_close(y, torch.cat(ys), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, h[0], rtol=1e-4, atol=1e-4)


def test_scan_and_conv_carry_state_across_any_split():
    g = torch.Generator().manual_seed(3)
    xc, w, b = torch.randn(30, C, generator=g), torch.randn(C, K, generator=g), torch.randn(C)
    t, state = inputs(30, seed=1)
    whole_conv, whole_conv_state = causal_conv1d(xc, torch.zeros(C, K - 1), w, b)
    whole_y, whole_state = ssd_chunk_scan(**t, chunk_size=8, initial_state=state)
    conv_state, ssm_state, conv_out, ys = torch.zeros(C, K - 1), state, [], []
    for lo, hi in [(0, 3), (3, 4), (4, 17), (17, 18), (18, 30)]:
        if hi - lo == 1:
            out, cs = causal_conv1d_step(xc[lo:hi], conv_state[None], w, b)
            conv_state = cs[0]
        else:
            out, conv_state = causal_conv1d(xc[lo:hi], conv_state, w, b)
        conv_out.append(out)
        y, ssm_state = ssd_chunk_scan(**{k: v[lo:hi] if v.shape[0] == 30 else v
                                         for k, v in t.items()}, chunk_size=8,
                                      initial_state=ssm_state)
        ys.append(y)
    torch.testing.assert_close(torch.cat(conv_out), whole_conv)
    torch.testing.assert_close(conv_state, whole_conv_state)
    torch.testing.assert_close(torch.cat(ys), whole_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ssm_state, whole_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_norms_match_transformers(norm_before_gate):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    g = torch.Generator().manual_seed(2)
    y, z, weight = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.rand(32)
    falcon = FalconH1RMSNormGated(32, eps=1e-5, n_groups=4, norm_before_gate=norm_before_gate)
    falcon.weight.data.copy_(weight)
    mine = gated_rms_norm(y, z, weight, 1e-5, 8, norm_before_gate)
    torch.testing.assert_close(mine, falcon(y[None], z[None])[0])
    if not norm_before_gate:
        mamba = MambaRMSNormGated(32, group_size=8, eps=1e-5)
        mamba.weight.data.copy_(weight)
        torch.testing.assert_close(mine, mamba(y, z))
    torch.testing.assert_close(gated_rms_norm(y, z, None, 1e-5, 8), y * F.silu(z))
