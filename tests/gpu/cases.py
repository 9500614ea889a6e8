"""Kernel-vs-reference checks shared by the GPU tests and their CPU-emulated twins.

Each ``check_*`` builds fresh random inputs on ``device``, runs the CUDA op (from
`heron.core.ops.cuda`, whatever backend `launch` routes to) with every output poisoned,
computes the torch ``*_ref`` in float32 from the same inputs, and asserts the op wrote
everything and is within `TOL` in relative norm.

Paged-attention inputs guard against stray reads: block ids are shuffled, block 0 is never
owned (the block-table padding points at it), and every cache slot no sequence owns holds
NaN, so reading one shows up as NaN in the output.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from heron.core.batch import AttentionMetadata
from heron.core.ops import cuda as cuda_ops
from heron.core.ops import (paged_attention_ref, rms_norm_ref, rope_cos_sin_cache, rotary_ref,
                            rotary_write_kv_ref, silu_and_mul_ref, write_kv_ref)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    nan = torch.isnan(out.float())
    assert not nan.any(), f"{what}: {int(nan.sum())} of {out.numel()} elements unwritten (NaN)"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g}"


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block, torch.empty / empty_like fill floating tensors with NaN.

    The ops allocate their outputs (and split-K scratch) with these, so an element a
    kernel never writes, or a scratch value it reads unwritten, surfaces as NaN.
    """
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------- pointwise ops


def check_rms_norm(device, dtype, num_rows, hidden, with_residual, seed=0):
    g = _gen(seed)
    x = _randn(num_rows, hidden, g=g, dtype=dtype, device=device)
    w = _randn(hidden, g=g, dtype=dtype, device=device, scale=0.5) + 1
    r = _randn(num_rows, hidden, g=g, dtype=dtype, device=device) if with_residual else None
    with poisoned_outputs():
        out, new_res = cuda_ops.rms_norm(x, w, 1e-6, r)
    ref, ref_res = rms_norm_ref(x.float(), w.float(), 1e-6, r.float() if r is not None else None)
    assert_close(out, ref, dtype, "rms_norm out")
    if with_residual:
        assert_close(new_res, ref_res, dtype, "rms_norm residual")
    else:
        assert new_res is None


def check_silu_and_mul(device, dtype, num_rows, inter, seed=0):
    g = _gen(seed)
    x = _randn(num_rows, 2 * inter, g=g, dtype=dtype, device=device, scale=2.0)
    with poisoned_outputs():
        out = cuda_ops.silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x.float()), dtype, "silu_and_mul")


def check_rotary(device, dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, rot_dim,
                 fused_qkv, seed=0):
    """``fused_qkv``: q and k are strided views of one [T, (Hq + 2 Hkv) * D] projection."""
    g = _gen(seed)
    cache = rope_cos_sin_cache(rot_dim, 8192, 10000.0).to(device)
    positions = torch.randint(0, 8192, (num_tokens,), generator=g).to(device)
    if fused_qkv:
        qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, g=g, dtype=dtype,
                     device=device)
        q, k, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, num_q_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
    else:
        q = _randn(num_tokens, num_q_heads, head_dim, g=g, dtype=dtype, device=device)
        k = _randn(num_tokens, num_kv_heads, head_dim, g=g, dtype=dtype, device=device)
    q_before, k_before = q.clone(), k.clone()
    with poisoned_outputs():
        q_rot, k_rot = cuda_ops.rotary(q, k, positions, cache)
    q_ref, k_ref = rotary_ref(q.float(), k.float(), positions, cache)
    assert_close(q_rot, q_ref, dtype, "rotary q")
    assert_close(k_rot, k_ref, dtype, "rotary k")
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "rotary modified its inputs"


def check_write_kv(device, dtype, num_tokens, num_kv_heads, head_dim, block_size, seed=0):
    """Writes through strided k/v views into layer 1 of a [L, 2, ...] pool; -1 slots skip."""
    g = _gen(seed)
    num_blocks = num_tokens // block_size + 4
    pool = _randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, g=g, dtype=dtype,
                  device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1  # padded rows
    kv = _randn(num_tokens, 2, num_kv_heads, head_dim, g=g, dtype=dtype, device=device)
    k, v = kv[:, 0], kv[:, 1]  # non-contiguous views
    expected = pool.clone()
    keep = slots >= 0
    write_kv_ref(k[keep.to(device)], v[keep.to(device)], expected[1, 0], expected[1, 1],
                 slots[keep].to(device))
    cuda_ops.write_kv(k, v, pool[1, 0], pool[1, 1], slots.to(device))
    assert torch.equal(pool, expected), "write_kv: cache differs from write_kv_ref"


def check_rotary_write_kv(device, dtype, num_tokens, num_q_heads, num_kv_heads, head_dim,
                          rot_dim, block_size, seed=0):
    """q, k, v are strided views of one fused projection; they go to layer 1 of a
    [L, 2, ...] pool; -1 slots (padded rows) write nothing but still rotate q."""
    g = _gen(seed)
    cache = rope_cos_sin_cache(rot_dim, 8192, 10000.0).to(device)
    positions = torch.randint(0, 8192, (num_tokens,), generator=g).to(device)
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, g=g, dtype=dtype,
                 device=device)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    num_blocks = num_tokens // block_size + 4
    pool = _randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, g=g, dtype=dtype,
                  device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    expected = pool.cpu().clone()
    q_ref = rotary_write_kv_ref(q.cpu().float(), k.cpu().float(), v.cpu(), positions.cpu(),
                                cache.cpu(), expected[1, 0], expected[1, 1], slots)
    with poisoned_outputs():
        q_rot = cuda_ops.rotary_write_kv(q, k, v, positions, cache, pool[1, 0], pool[1, 1],
                                         slots.to(device))
    assert_close(q_rot, q_ref, dtype, "rotary_write_kv q")
    got, written = pool.cpu().clone(), slots[slots >= 0]

    def rows(p: torch.Tensor) -> torch.Tensor:  # layer 1's k and v as [2, slots, Hkv, D] views
        return p[1].view(2, -1, num_kv_heads, head_dim)

    assert_close(rows(got)[0, written], rows(expected)[0, written], dtype, "rotary_write_kv k")
    assert torch.equal(rows(got)[1, written], rows(expected)[1, written]), "rotary_write_kv: v differs"
    rows(got)[:, written] = 0
    rows(expected)[:, written] = 0
    assert torch.equal(got, expected), "rotary_write_kv wrote past its slots"


# ---------------------------------------------------------------------------- attention


@dataclass
class PagedCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_paged_case(query_lens, seq_lens, *, num_q_heads, num_kv_heads, head_dim, block_size,
                    dtype, device, seed=0, max_seq_len=None) -> PagedCase:
    """A batch whose sequence i has ``seq_lens[i]`` keys cached, the last ``query_lens[i]``
    of them this step's queries. ``max_seq_len`` may exceed the real maximum (a graph bound).
    """
    g = _gen(seed)
    num_seqs = len(seq_lens)
    max_seq_len = max_seq_len or max(seq_lens)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    ids = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()  # block 0: never owned
    width = max(max(blocks_per_seq), math.ceil(max_seq_len / block_size)) + 1
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    pool = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                      dtype=torch.float32)
    k_cache, v_cache = pool[1, 0], pool[1, 1]  # layer 1 of the engine's [L, 2, ...] tensor
    slot_mapping = []
    for i, (q_len, s) in enumerate(zip(query_lens, seq_lens)):
        tables[i, :blocks_per_seq[i]] = torch.tensor(ids[:blocks_per_seq[i]], dtype=torch.int32)
        del ids[:blocks_per_seq[i]]
        pos = torch.arange(s)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=g)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=g)
        slot_mapping.append(slots[s - q_len:])
    pool = pool.to(dtype=dtype, device=device)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=g).to(dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device), query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens), max_query_len=max(query_lens), max_seq_len=max_seq_len,
        block_size=block_size)
    return PagedCase(q, pool[1, 0], pool[1, 1], meta, head_dim ** -0.5)


def reference_attention(case: PagedCase) -> torch.Tensor:
    """`paged_attention_ref` in float32; unowned (NaN) slots zeroed, as masked keys are."""
    k = case.k_cache.float().nan_to_num(0.0)
    v = case.v_cache.float().nan_to_num(0.0)
    return paged_attention_ref(case.q.float(), k, v, case.meta, case.scale)


def check_paged_attention(device, dtype, query_lens, seq_lens, *, num_q_heads, num_kv_heads,
                          head_dim, block_size, seed=0, max_seq_len=None):
    case = make_paged_case(query_lens, seq_lens, num_q_heads=num_q_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                           dtype=dtype, device=device, seed=seed, max_seq_len=max_seq_len)
    with poisoned_outputs():
        out = cuda_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == dtype
    assert_close(out, reference_attention(case), dtype, "paged_attention")
    return case


def check_decode_padded_rows(device, dtype, seq_lens=(300, 1, 77), max_seq_len=512):
    """CUDA-graph padding: a row with seq_len 0 gets zeros, the real rows are unaffected.

    Row 1 is the padded one. ``max_seq_len <= 64`` exercises the single-split path.
    """
    case = make_paged_case([1] * len(seq_lens), list(seq_lens), num_q_heads=8, num_kv_heads=2,
                           head_dim=64, block_size=16, dtype=dtype, device=device,
                           max_seq_len=max_seq_len)
    ref = reference_attention(case)
    case.meta.seq_lens[1] = 0
    with poisoned_outputs():
        out = cuda_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(out[1].float().cpu(), torch.zeros_like(out[1].float().cpu()))
    keep = [i for i in range(len(seq_lens)) if i != 1]
    assert_close(out[keep], ref[keep], dtype, "paged_attention with a padded row")


# ---------------------------------------------------------------------------- LoRA


def check_lora(device, dtype, num_rows, in_features, out_features, rank, num_slots, segments,
               seed=0):
    """`add_lora_rows` on ``segments`` ``(slot, first row, end row)`` against `add_lora`'s
    segment form in float32; ``out`` is a column slice of a fused projection and ``x`` a
    strided view. Rows outside every segment must come out unchanged."""
    from heron.core.ops.lora import add_lora
    g = _gen(seed)
    x = _randn(num_rows, in_features + 8, g=g, dtype=dtype, device=device)[:, 8:]
    proj = _randn(num_rows, out_features + 32, g=g, dtype=dtype, device=device)
    out = proj[:, 16:16 + out_features]
    a = _randn(num_slots, rank, in_features, g=g, dtype=dtype, device=device, scale=0.2)
    b = _randn(num_slots, rank, out_features, g=g, dtype=dtype, device=device, scale=0.2)
    scaling = [0.5 + i for i in range(num_slots)]
    ref = out.float().cpu().clone()
    add_lora(ref, x.float().cpu(), a.float().cpu(), b.float().cpu(), scaling, segments)
    slots = torch.full((num_rows,), -1, dtype=torch.int64)
    scales = torch.zeros(num_rows, dtype=torch.float32)
    for slot, r0, r1 in segments:
        slots[r0:r1], scales[r0:r1] = slot, scaling[slot]
    before = proj.clone()
    with poisoned_outputs():
        cuda_ops.add_lora_rows(out, x, a, b, slots.to(device), scales.to(device))
    assert_close(out, ref, dtype, "add_lora_rows")
    covered = {r for _, r0, r1 in segments for r in range(r0, r1)}
    untouched = [r for r in range(num_rows) if r not in covered]
    assert torch.equal(proj[untouched].cpu(), before[untouched].cpu()), \
        "rows without adapter changed"
    assert torch.equal(proj[:, :16].cpu(), before[:, :16].cpu()), "columns outside out changed"
