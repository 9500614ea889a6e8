"""The CPU paged attention (`paged_attention_ref`) against attention written out in float64
over each sequence's own contiguous K/V, on each of its paths: decode rows in one call (a
block-diagonal matmul or SDPA), every sequence's queries padded into one call (drafts, short
prompts), and a sequence at a time (a long prompt, the decode rows beside it in one call)."""

from __future__ import annotations

import pytest
import torch

from heron.core.ops import paged_attention_ref
from heron.core.workspace import Workspace
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


def nan_free(case):
    # unowned slots hold NaN; the engine's hold zeros or stale finite K/V
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    return case


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1, 1, 1], [5, 17, 9]),            # decode
    ([1, 4, 3, 1, 2], [7, 20, 3, 1, 33]),  # decode rows with drafts and short prompts: padded
    ([2, 2, 2, 2], [2, 2, 2, 2]),        # short prompts of one length: nothing to pad
    ([4, 4, 4], [10, 21, 6]),            # decode rows with as many drafts: nothing to pad
    ([90, 1, 1], [90, 5, 9]),            # one long prompt: a sequence at a time, the
    ([1, 80, 1, 1], [40, 130, 1, 13]),   # decode rows beside it (or a chunk) in one call
    ([60], [60]),                        # one prompt alone
    ([25], [61]),                        # one chunk after its cached start
])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, block_diagonal", [
    (4, 2, True),    # decode: the block-diagonal matmul (batches of many keys)
    (4, 2, False),   # decode: SDPA
    (12, 6, True),   # decode: SDPA (too many KV heads for the block-diagonal matmul)
    (5, 5, False),
])
def test_paged_attention_matches_attention_written_out(query_lens, seq_lens, num_q_heads,
                                                       num_kv_heads, block_diagonal,
                                                       monkeypatch):
    if block_diagonal:
        monkeypatch.setattr("heron.core.ops.attention.BLOCK_DIAGONAL_MIN_KEYS", 0)
    case = nan_free(make_paged_case(query_lens, seq_lens, num_q_heads=num_q_heads,
                                    num_kv_heads=num_kv_heads, head_dim=16, block_size=4,
                                    dtype=torch.float32, device="cpu", seed=3))
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), written_out(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_sharing_a_workspace(dtype, monkeypatch):
    """Decode steps of several sizes, and a step mixing decode rows with a prompt, gather
    into one workspace, whose buffers hold the previous step's keys."""
    monkeypatch.setattr("heron.core.ops.attention.BLOCK_DIAGONAL_MIN_KEYS", 0)
    workspace = Workspace()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seed, (query_lens, seq_lens) in enumerate([
            ([1] * 6, [40, 3, 77, 12, 64, 5]), ([1, 1], [9, 30]), ([1] * 4, [81, 2, 17, 33]),
            ([1, 90, 1], [50, 90, 8])]):
        case = nan_free(make_paged_case(query_lens, seq_lens, num_q_heads=6, num_kv_heads=2,
                                        head_dim=16, block_size=4, dtype=dtype, device="cpu",
                                        seed=seed))
        case.meta.workspace = workspace
        out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        torch.testing.assert_close(out.double(), written_out(case), rtol=tol, atol=tol)


def share_blocks(case, members, num_blocks):
    """Make ``members`` read sequence ``members[0]``'s first ``num_blocks`` blocks, as the
    prefix cache has requests with one prompt do."""
    tables = case.meta.block_tables
    tables[members, :num_blocks] = tables[members[0], :num_blocks].clone()
    return case


@pytest.mark.parametrize("seq_lens, groups", [
    ([20, 17, 30, 13, 9], [([0, 1, 2, 3], 3)]),          # four share 3 blocks, one alone
    ([20, 16, 29, 9, 25, 14], [([0, 1, 2], 4), ([3, 4, 5], 2)]),  # two groups; 16: its
    # fourth block ends at its query, so the group shares 3
    ([33, 33], [([0, 1], 8)]),                            # n samples of one prompt
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_a_shared_prefix_once(seq_lens, groups, dtype, monkeypatch):
    monkeypatch.setattr("heron.core.batch.MIN_SHARED_KEYS", 1)
    case = make_paged_case([1] * len(seq_lens), seq_lens, num_q_heads=6, num_kv_heads=2,
                           head_dim=16, block_size=4, dtype=dtype, device="cpu", seed=5)
    for members, num_blocks in groups:
        share_blocks(case, members, num_blocks)
    nan_free(case)
    plan = case.meta.shared_prefix_plan
    assert plan is not None and len(plan.groups) == len(groups)
    expected = [min(n, min((seq_lens[i] - 1) // 4 for i in m)) * 4 for m, n in groups]
    assert [len(slots) for _, slots in plan.groups] == expected
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), written_out(case), rtol=tol, atol=tol)


def test_a_shared_prefix_is_split_out_only_where_it_pays():
    def case(query_len, num_seqs, shared_blocks):
        return share_blocks(make_paged_case([query_len] * num_seqs, [200] * num_seqs,
                                            num_q_heads=4, num_kv_heads=2, head_dim=16,
                                            block_size=16, dtype=torch.float32, device="cpu"),
                            list(range(num_seqs)), shared_blocks)

    assert case(1, 8, 7).meta.shared_prefix_plan is None  # 112 shared keys: one call is faster
    plan = case(1, 8, 8).meta.shared_prefix_plan
    assert plan is not None and len(plan.groups[0][1]) == 128
    assert case(1, 1, 8).meta.shared_prefix_plan is None  # nobody to share with
    assert case(2, 8, 8).meta.shared_prefix_plan is None  # drafts: the padded path


def test_single_query_part_names_the_decode_rows_beside_a_chunk():
    def meta(query_lens, seq_lens):
        return make_paged_case(query_lens, seq_lens, num_q_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=4, dtype=torch.float32,
                               device="cpu").meta

    full = meta([1, 80, 1, 1], [40, 130, 1, 13])
    rows, part = full.single_query_part
    assert rows.tolist() == [0, 81, 82] and part.is_decode_only
    assert part.seq_lens_list == [40, 1, 13] and part.max_seq_len == 40
    assert part.block_tables.tolist() == full.block_tables[[0, 2, 3]].tolist()
    assert part.slot_mapping.tolist() == full.slot_mapping[[0, 81, 82]].tolist()
    assert meta([1, 1], [5, 9]).single_query_part is None  # all decode: one call anyway
    assert meta([3, 2], [5, 9]).single_query_part is None
