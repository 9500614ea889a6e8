"""Decode-attention variants (plan.DecodeConfig knobs), shared by the GPU tests and their
CPU-emulated twins: which knob sets to run, on which batches, and the check itself.

Every knob set must compute the same function, so each runs the same reference check as the
default plan (`cases.check_paged_attention`: shuffled block tables, NaN in every unowned
cache slot, poisoned outputs), plus padded graph rows (``seq_len == 0`` -> zeros).
"""

from __future__ import annotations

import torch

from heron.core.ops import cuda as cuda_ops
from heron.core.ops.cuda import plan
from tests.gpu import cases

#: Non-default decode plans, by name: both kernels (tensor-core "mma", CUDA-core "fma"), more
#: and fewer warps, rows in flight, prefetch, a register cap, forced / bounded partitions.
DECODE_CONFIGS = {
    "mma-w8-u2-prefetch-p96": dict(kernel="mma", warps=8, unroll=2, prefetch=True, partition_size=96),
    "mma-w2-minblocks3-p16..128": dict(kernel="mma", warps=2, min_partition=16, max_partition=128,
                                       min_blocks=3),
    "fma-w2-u2-lanes8-prefetch": dict(kernel="fma", warps=2, unroll=2, key_lanes=8, prefetch=True,
                                      ctas_per_sm=8),
    "fma-w8-u1-ctas1": dict(kernel="fma", warps=8, unroll=1, ctas_per_sm=1),
}

_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def supported(config: dict, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether ``config`` can run this shape (a forced mma kernel needs a half type, ...)."""
    return config.get("kernel") != "mma" or plan.decode_mma_supported(_CODES[dtype], head_dim, group)


def expected_plan(config: dict, dtype, seq_lens, num_q_heads, num_kv_heads, head_dim,
                  max_seq_len, num_sms) -> plan.DecodePlan:
    return plan.plan_decode(len(seq_lens), num_kv_heads, max_seq_len, num_sms,
                            num_q_heads // num_kv_heads, head_dim, _CODES[dtype],
                            plan.DecodeConfig(**config))


def check_decode(device, dtype, seq_lens, *, num_q_heads, num_kv_heads, head_dim, block_size,
                 max_seq_len=None, seed=0):
    """Decode one query per sequence against `paged_attention_ref` (float32) under the
    current `plan.DECODE_CONFIG`; a 0 in ``seq_lens`` is a padded CUDA-graph row, whose
    output must be exactly zero while the other rows are unaffected."""
    real = [s or 1 for s in seq_lens]
    case = cases.make_paged_case([1] * len(real), real, num_q_heads=num_q_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 block_size=block_size, dtype=dtype, device=device, seed=seed,
                                 max_seq_len=max_seq_len)
    ref = cases.reference_attention(case)
    padded = [i for i, s in enumerate(seq_lens) if s == 0]
    for i in padded:
        case.meta.seq_lens[i] = 0
        case.meta.seq_lens_list[i] = 0
    with cases.poisoned_outputs():
        out = cuda_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == dtype
    for i in padded:
        row = out[i].float().cpu()
        assert torch.equal(row, torch.zeros_like(row)), f"padded row {i} is not all zeros"
    keep = [i for i in range(len(seq_lens)) if i not in padded]
    cases.assert_close(out[keep], ref[keep], dtype, f"decode {plan.DECODE_CONFIG}")
    return case
