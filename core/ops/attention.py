"""Paged attention over the engine's KV blocks: KV write, then causal attention.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
The torch functions here are the CPU path and the reference the CUDA kernels and the CPU
kernels are tested against. On the CPU, attention goes to compiled kernels
(``kernels/paged_attention_cpu.cpp``: one for decode rows, one for prompts, both reading the
blocks in place) where the metadata asks for them and they apply (float32 or bfloat16
caches, head sizes a multiple of 16); the torch ops gather whole blocks into the step's
`Workspace` first, which costs about as much as attending to them. The rotary embedding
with the KV write goes to one too (``kernels/rotary_cpu.cpp``) wherever it builds: a decode
step's dozen small torch ops for it cost more in dispatch than in arithmetic. A step's decode rows
beside a prompt chunk attend in one call, and with the torch ops a decode batch whose
sequences share a long prefix reads it once (`SharedPrefixPlan`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from heron.core import cpu_kernels
from heron.core.batch import AttentionMetadata, SharedPrefixPlan
from heron.core.ops.rotary import rotary_ref
from heron.core.workspace import Workspace


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at flat slots ``slot_mapping [T]`` of the caches, in place;
    rows whose slot is negative (padding) store nothing."""
    keep = slot_mapping >= 0
    if not keep.all():
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rotary_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
    """`rotary_ref` of ``q`` and ``k``, then `write_kv_ref` of the rotated ``k`` and ``v``;
    returns the rotated ``q``. (The CUDA op does both in one launch.)"""
    q, k = rotary_ref(q, k, positions, cos_sin_cache)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


# Decode attention as one block-diagonal matmul per sequence does KV-heads times the
# multiply-adds of the attention itself, and a few more small ops; with few KV heads and a
# batch of many keys that costs less than SDPA's per-head work on the CPU. Measured with 3 KV
# heads and 1.2k-token contexts: decode steps 15% faster for 32 sequences, even for 16,
# 8% slower for 1 to 8; with 5 KV heads about even, with 8 1.6x slower
BLOCK_DIAGONAL_MAX_KV_HEADS = 4
BLOCK_DIAGONAL_MIN_KEYS = 16384  # sequences x padded context length


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the torch call where ``t`` has that dtype already (a decode
    step's attention runs once a layer, and on the CPU each torch call costs microseconds)."""
    return t if t.dtype is dtype else t.to(dtype)


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows at flat ``slots [B, L]``: ``[B, L, H, D]``."""
    rows = cache.reshape(-1, cache.shape[-2] * cache.shape[-1]).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[-2:])


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, workspace: Workspace | None,
                   name: str) -> torch.Tensor:
    """The keys (or values) of the cache's blocks ``blocks [n]``, in order: ``[n * block_size,
    H, D]``, in ``name``'s buffer of ``workspace`` where there is one."""
    # index_select over whole-block rows is a plain row copy, several times faster on the
    # CPU than advanced indexing (`cache[blocks]`), which goes element by element
    rows = cache.reshape(cache.shape[0], -1)
    out = None if workspace is None else workspace.take(name, (blocks.numel(), rows.shape[1]),
                                                         cache)
    return torch.index_select(rows, 0, blocks, out=out).view(-1, *cache.shape[-2:])


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Attention of one query per sequence, ``q [B, Hq, D]`` in the cache's dtype."""
    if meta.cpu_kernels:  # faster than the torch paths, a shared prefix's included
        out = _compiled_decode(q, k_cache, v_cache, meta, scale)
        if out is not None:
            return out
    plan = None if q.is_cuda else meta.shared_prefix_plan
    if plan is not None:  # sequences sharing a long prefix read it once
        return _shared_prefix_decode(q, k_cache, v_cache, plan, scale)
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    # whole blocks: the keys past a sequence's length (its last block's tail, padding
    # blocks) are masked
    blocks, keep = meta.whole_blocks_and_mask
    shape = (num_seqs, keep.shape[-1], kv_heads * head_dim)
    k = _gather_blocks(k_cache, blocks, meta.workspace, "keys").view(shape)
    v = _gather_blocks(v_cache, blocks, meta.workspace, "values").view(shape)
    if (kv_heads > BLOCK_DIAGONAL_MAX_KV_HEADS or num_seqs * shape[1] < BLOCK_DIAGONAL_MIN_KEYS
            or q.dtype != torch.float32):
        k, v = (t.view(*shape[:2], kv_heads, head_dim).transpose(1, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=keep,
                                              scale=scale, enable_gqa=True).squeeze(2)
    # Each sequence's queries as a block-diagonal [Hq, Hkv * D] matrix (a query head's row
    # holds its query in its KV head's columns, zeros elsewhere): one matmul with the keys
    # and one with the values per sequence, reading each once
    group = heads // kv_heads
    eye = torch.eye(kv_heads, dtype=q.dtype, device=q.device).view(1, kv_heads, 1, kv_heads, 1)
    diagonal = (q.view(num_seqs, kv_heads, group, 1, head_dim) * eye).view(num_seqs, heads, -1)
    scores = torch.bmm(diagonal, k.transpose(1, 2)).mul_(scale)  # [B, Hq, L]
    weights = scores.masked_fill_(~keep.view(num_seqs, 1, -1), float("-inf")).softmax(-1)
    out = torch.bmm(weights, v).view(num_seqs, kv_heads, group, kv_heads, head_dim)
    # each query head's output is its own KV head's block: the diagonal
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(num_seqs, heads, head_dim)


# A task of the compiled decode kernel covers up to this many keys of one sequence: fewer
# where there are few sequences, so every thread gets several tasks
PART_KEYS_MIN, PART_KEYS_MAX = 256, 2048


def _kernel_inputs_fit(q, k_cache, v_cache, meta: AttentionMetadata) -> bool:
    """Whether the compiled CPU kernels take these tensors as they are."""
    tables = meta.block_tables
    return (q.is_cpu and compiled_attention_applies(k_cache.dtype, q.shape[-1])
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and tables.dtype == torch.int32 and tables.stride(-1) == 1)


def _compiled_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """`_decode` by the compiled CPU kernel; None where it does not apply or is not built."""
    if not _kernel_inputs_fit(q, k_cache, v_cache, meta):
        return None
    num_seqs, heads, head_dim = q.shape
    tables, lens = meta.block_tables, _as(meta.seq_lens, torch.int32).contiguous()
    query = _as(q, torch.float32).contiguous()
    out = torch.empty_like(query)
    kv_heads = k_cache.shape[-2]
    # the kernel sizes its tasks by the lengths it reads, not the host's copy of them, which
    # a replayed step's batch has at its bound
    failed = _kernels(head_dim, k_cache.dtype).heron_decode_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), num_seqs, kv_heads, heads // kv_heads,
        meta.block_size, scale, PART_KEYS_MIN, PART_KEYS_MAX, 4 * torch.get_num_threads(),
        out.data_ptr())
    return None if failed else _as(out, q.dtype)


def _compiled_prefill(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """`paged_attention_ref` of a step with prompt rows by the compiled CPU kernels (decode
    rows beside them by the decode kernel); None where they do not apply or are not built."""
    if not _kernel_inputs_fit(q, k_cache, v_cache, meta):
        return None
    tables = meta.block_tables
    query = q.float().contiguous()
    out = torch.empty_like(query)
    decodes = meta.single_query_part
    if decodes is not None:
        rows, sub = decodes
        decoded = _compiled_decode(query[rows], k_cache, v_cache, sub, scale)
        if decoded is None:
            return None
        out[rows] = decoded
    starts = meta.query_start_loc.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    kv_heads = k_cache.shape[-2]
    failed = _kernels(q.shape[-1], k_cache.dtype).heron_prefill_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), starts.data_ptr(), meta.prompt_query_lens.data_ptr(),
        seq_lens.data_ptr(), meta.num_seqs, kv_heads, q.shape[1] // kv_heads,
        meta.block_size, scale, out.data_ptr())
    return None if failed else out.to(q.dtype)


def compiled_attention_applies(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over a CPU cache of ``dtype`` and ``head_dim`` can run the compiled
    kernels (which this builds, if not yet built)."""
    return (dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0
            and _kernels(head_dim, dtype) is not None)


@functools.cache
def _kernels(head_dim: int, dtype: torch.dtype, vec_floats: int | None = None):
    """The compiled attention kernels for ``head_dim`` and a cache of ``dtype``, their
    argument types set; None if not built. ``vec_floats`` (8, 16) builds them for vectors of
    that many floats rather than the machine's register width."""
    defines = {"HEAD_DIM": head_dim, **({"CACHE_BF16": 1} if dtype == torch.bfloat16 else {})}
    lib = cpu_kernels.load("paged_attention_cpu.cpp", defines, vec_floats)
    if lib is None:
        return None
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    lib.heron_decode_attention.argtypes = [p, p, p, p, i64, p, i32, i32, i32, i32, f32, i32,
                                           i32, i32, p]
    lib.heron_prefill_attention.argtypes = [p, p, p, p, i64, p, p, p, i32, i32, i32, i32, f32,
                                            p]
    lib.heron_decode_attention.restype = lib.heron_prefill_attention.restype = ctypes.c_int
    return lib


def _padded(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Every sequence's queries and context padded to the longest, one SDPA call."""
    # rows, not whole blocks: a short context's last block is mostly not its own yet
    slots = meta.padded_slots
    k = _gather_slots(k_cache, slots).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_slots(v_cache, slots).transpose(1, 2)
    q = q.to(k.dtype)
    place, causal = meta.padded_queries
    width, (heads, head_dim) = meta.max_query_len, q.shape[1:]
    # every sequence with `width` queries (one prompt; drafts of one length): no padding
    padding = meta.num_seqs * width != q.shape[0]
    padded = q.new_zeros(meta.num_seqs * width, heads, head_dim).index_copy_(0, place, q) \
        if padding else q
    padded = padded.reshape(meta.num_seqs, width, heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(padded, k, v, attn_mask=causal, scale=scale,
                                         enable_gqa=True)  # [B, Hq, width, D]
    out = out.transpose(1, 2).reshape(-1, heads, head_dim)
    return out.index_select(0, place) if padding else out


# SDPA that also returns each query's log-sum-exp, which merging two parts of one softmax
# needs (``(out [B, H, M, D], lse [B, H, M])``; the mask is additive, in q's dtype)
_sdpa_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _shared_prefix_decode(q, k_cache, v_cache, plan: SharedPrefixPlan, scale: float):
    """Decode attention as `SharedPrefixPlan` splits it; ``q [B, Hq, D]``."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = heads // kv_heads
    # a KV head's query heads become its rows of queries, so one call reads its keys once
    q = q.view(num_seqs, kv_heads, group, head_dim)
    k = _gather_slots(k_cache, plan.suffix_slots).transpose(1, 2)  # [B, Hkv, Ls, D]
    v = _gather_slots(v_cache, plan.suffix_slots).transpose(1, 2)
    out, lse = _sdpa_with_lse(q, k, v, attn_mask=plan.suffix_bias.to(q.dtype), scale=scale)
    for members, slots in plan.groups:
        everyone = members is None
        qm = q if everyone else q.index_select(0, members)
        # every member's queries as the rows of one sequence over the shared keys
        qm = qm.transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
        kp = _gather_slots(k_cache, slots[None]).transpose(1, 2)  # [1, Hkv, P, D]
        vp = _gather_slots(v_cache, slots[None]).transpose(1, 2)
        out_p, lse_p = _sdpa_with_lse(qm, kp, vp, scale=scale)
        out_p = out_p.view(kv_heads, -1, group, head_dim).transpose(0, 1)
        lse_p = lse_p.view(kv_heads, -1, group).transpose(0, 1)
        out_s = out if everyone else out.index_select(0, members)
        lse_s = lse if everyone else lse.index_select(0, members)
        # the softmax over both parts: each part's output weighted by its share of the sum
        # of exponentials, exp(lse_s) / (exp(lse_s) + exp(lse_p)) for the suffix
        share = torch.sigmoid(lse_s - lse_p).unsqueeze(-1).to(out.dtype)
        merged = torch.lerp(out_p, out_s, share)
        if everyone:
            out = merged
        else:
            out.index_copy_(0, members, merged)
    return out.reshape(num_seqs, heads, head_dim)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over each sequence's cached context.

    The KV of this step's tokens must already be written (`write_kv`). Query ``j`` of a
    sequence with ``query_len`` queries and ``seq_len`` keys sees keys
    ``0 .. seq_len - query_len + j``. Returns ``[T, Hq, D]`` in q's dtype.
    """
    if meta.is_decode_only:
        return _as(_decode(_as(q, k_cache.dtype), k_cache, v_cache, meta, scale), q.dtype)
    if meta.cpu_kernels:
        out = _compiled_prefill(q, k_cache, v_cache, meta, scale)
        if out is not None:
            return out
    # one padded call when padding costs little (speculative drafts, short prompts); a
    # sequence at a time when one long prompt would pad everyone to its length
    num_seqs, num_rows = meta.num_seqs, q.shape[0]
    if num_seqs > 1 and (num_seqs * meta.max_query_len <= 2 * num_rows + 64 and
                         num_seqs * meta.max_seq_len <= 2 * sum(meta.seq_lens_list) + 1024):
        return _padded(q, k_cache, v_cache, meta, scale).to(q.dtype)
    out = torch.empty_like(q)
    decodes = meta.single_query_part
    if decodes is not None:  # the decode rows beside a prompt chunk, in one call
        rows, sub = decodes
        out[rows] = _decode(q[rows].to(k_cache.dtype), k_cache, v_cache, sub, scale).to(q.dtype)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len == 1 and decodes is not None:
            start += 1
            continue
        num_blocks = (seq_len + meta.block_size - 1) // meta.block_size
        blocks = meta.block_tables[i, :num_blocks].long()
        # [1, H, L, D]: with no batch dimension SDPA takes its unfused path on the CPU,
        # an order of magnitude slower on a long prompt
        k = _gather_blocks(k_cache, blocks, meta.workspace, "keys")[:seq_len]
        v = _gather_blocks(v_cache, blocks, meta.workspace, "values")[:seq_len]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        qi = q[start:start + q_len].transpose(0, 1)[None].to(k.dtype)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            last = torch.arange(q_len, device=q.device)[:, None] + seq_len - q_len
            mask = torch.arange(seq_len, device=q.device)[None, :] <= last
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1).to(q.dtype)
        start += q_len
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    if k.is_cuda:
        from heron.core.ops import cuda
        return cuda.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _compiled_rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                              slot_mapping):
    """`rotary_write_kv_ref` by the compiled kernel: float32 rows into float32 or bfloat16
    caches, bfloat16 rows into bfloat16 caches; None where it does not apply or is not
    built."""
    head_dim = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype and cos_sin_cache.dtype == torch.float32
            and (q.dtype, k_cache.dtype) in _ROTARY_DTYPES
            and k_cache.dtype == v_cache.dtype and cos_sin_cache.shape[-1] <= head_dim
            and k_cache.shape == v_cache.shape and k_cache.shape[-2:] == k.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cos_sin_cache.is_contiguous()
            and q.stride(1) == k.stride(1) == v.stride(1) == head_dim
            and q.stride(2) == k.stride(2) == v.stride(2) == 1
            and positions.dtype == slot_mapping.dtype == torch.int64
            and positions.is_contiguous() and slot_mapping.is_contiguous()):
        return None
    lib = _rotary_kernel(q.dtype, k_cache.dtype)
    if lib is None:
        return None
    out = torch.empty(q.shape, dtype=q.dtype)
    num_slots = k_cache.numel() // (k.shape[1] * head_dim)
    failed = lib.heron_rotary_write_kv(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
        cos_sin_cache.shape[1], slot_mapping.data_ptr(), num_slots, q.shape[0], q.shape[1],
        k.shape[1], head_dim, out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    return None if failed else out  # out of bounds: the torch ops say where


# (rows, caches) the compiled rotary takes, and the define that builds it for them
_ROTARY_DTYPES = {(torch.float32, torch.float32): {},
                  (torch.float32, torch.bfloat16): {"CACHE_BF16": 1},
                  (torch.bfloat16, torch.bfloat16): {"ACT_BF16": 1}}


@functools.cache
def _rotary_kernel(dtype: torch.dtype, cache_dtype: torch.dtype):
    """The compiled rotary-and-KV-write of ``dtype`` rows into caches of ``cache_dtype``,
    its argument types set; None if not built."""
    lib = cpu_kernels.load("rotary_cpu.cpp", _ROTARY_DTYPES[dtype, cache_dtype])
    if lib is None:
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.heron_rotary_write_kv.argtypes = [p, i64, p, i64, p, i64, p, p, i64, i32, p, i64, i64,
                                          i32, i32, i32, p, p, p]
    lib.heron_rotary_write_kv.restype = ctypes.c_int
    return lib


def rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    if q.is_cuda:
        from heron.core.ops import cuda
        return cuda.rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                    slot_mapping)
    if q.is_cpu and q.shape[0]:
        out = _compiled_rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                        slot_mapping)
        if out is not None:
            return out
    return rotary_write_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta, scale):
    if q.is_cuda:
        from heron.core.ops import cuda
        return cuda.paged_attention(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
