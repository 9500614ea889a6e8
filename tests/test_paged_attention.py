"""The CPU paged attention (`paged_attention_ref`) against attention written out in float64
over each sequence's own contiguous K/V, on both of its paths: every sequence's queries padded
into one call (decode rows, drafts, short prompts), and a sequence at a time (a long prompt
beside short ones)."""

from __future__ import annotations

import pytest
import torch

from heron.core.ops import paged_attention_ref
from tests.gpu.cases import make_paged_case


def written_out(case) -> torch.Tensor:
    meta, out, start = case.meta, [], 0
    hq, hkv = case.q.shape[1], case.k_cache.shape[-2]
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[i, pos // meta.block_size].long()
        k = case.k_cache[blocks, pos % meta.block_size].double()  # [L, Hkv, D]
        v = case.v_cache[blocks, pos % meta.block_size].double()
        k, v = (t.repeat_interleave(hq // hkv, dim=1).transpose(0, 1) for t in (k, v))
        q = case.q[start:start + q_len].double().transpose(0, 1)  # [Hq, q_len, D]
        scores = q @ k.transpose(1, 2) * case.scale
        sees = pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        weights = scores.masked_fill(~sees, float("-inf")).softmax(-1)
        out.append((weights @ v).transpose(0, 1))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1, 1, 1], [5, 17, 9]),            # decode
    ([1, 4, 3, 1, 2], [7, 20, 3, 1, 33]),  # decode rows with drafts and short prompts: padded
    ([2, 2, 2, 2], [2, 2, 2, 2]),        # short prompts of one length: nothing to pad
    ([4, 4, 4], [10, 21, 6]),            # decode rows with as many drafts: nothing to pad
    ([90, 1, 1], [90, 5, 9]),            # one long prompt: a sequence at a time
])
def test_paged_attention_matches_attention_written_out(query_lens, seq_lens):
    case = make_paged_case(query_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                           block_size=4, dtype=torch.float32, device="cpu", seed=3)
    # unowned slots hold NaN; the engine's hold zeros or stale finite K/V
    k, v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    case.k_cache, case.v_cache = k, v
    out = paged_attention_ref(case.q, k, v, case.meta, case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)
