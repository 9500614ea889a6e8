"""CUDA `paged_attention`: decode (kernels/attention_decode.cu) and prefill
(kernels/attention_prefill_mma.cu on tensor cores for float16 / bfloat16, else
kernels/attention_prefill.cu; see `PREFILL_KERNEL`), same contract as
`heron.core.ops.attention.paged_attention_ref`.

CUDA-graph contract of the decode path (``meta.max_query_len == 1``): the launch shapes depend
only on ``num_seqs``, ``meta.max_seq_len``, the model's head counts and the device, never on
``meta.seq_lens_list`` / ``query_lens_list``. Sequence lengths and block tables are read from
the device tensors ``meta.seq_lens`` and ``meta.block_tables`` at run time. So capture one
graph per (num_seqs, context bound) with ``meta.max_seq_len`` set to the bound, and update
the tensors in place before each replay; every ``seq_lens[b]`` must stay <= the bound, and
a padded row may use ``seq_lens[b] == 0`` (its output is zeros). The partial-result buffers
are allocated inside the call (in capture, from the graph's private pool).
"""

from __future__ import annotations

import math
import os

import torch

from heron.core.ops.cuda.cache import cache_strides
from heron.core.ops.cuda.launch import dtype_code, device_info, f32, i32, i64, launch, vec_elems
from heron.core.ops.cuda.plan import (PREFILL_MMA_MAX_HEAD_DIM, MmaTile, plan_decode,
                                      plan_prefill_mma, plan_prefill_tile, prefill_mma_smem_bytes,
                                      prefill_mma_supported, prefill_smem_bytes)

_LOG2E = math.log2(math.e)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                    scale: float) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over each sequence's paged context; ``[T, Hq, D]``.

    ``meta`` is a `heron.core.batch.AttentionMetadata` (duck-typed: ``block_tables``,
    ``seq_lens``, ``query_start_loc``, ``max_query_len``, ``max_seq_len``). Query ``j`` of a
    sequence with ``query_len`` queries and ``seq_len`` keys sees keys
    ``0 .. seq_len - query_len + j``; this step's K/V must already be written.
    Computes in the cache dtype with float32 accumulation; returns q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the KV cache {tuple(k_cache.shape)}")
    strides = cache_strides(k_cache, v_cache)
    vec = vec_elems(k_cache.dtype)
    if any(s % vec for s in strides) or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        raise ValueError("KV cache rows must be 16-byte aligned for the CUDA kernels")
    out_dtype = q.dtype
    q = q.to(k_cache.dtype)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.device)
    block_tables = _int32(meta.block_tables)
    seq_lens = _int32(meta.seq_lens)
    defines = {"HERON_DTYPE": dtype_code(k_cache.dtype), "HEAD_DIM": head_dim,
               "GROUP_SIZE": num_q_heads // num_kv_heads, "BLOCK_SIZE": k_cache.shape[1]}
    if meta.max_query_len == 1:
        out = _decode(q, k_cache, v_cache, strides, block_tables, seq_lens, meta.max_seq_len,
                      defines, scale)
    else:
        out = _prefill(q, k_cache, v_cache, strides, block_tables, seq_lens,
                       _int32(meta.query_start_loc), meta.max_query_len, defines, scale)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Index tensors as the kernels read them: int32, last dim contiguous (rows may be strided)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _decode(q, k_cache, v_cache, strides, block_tables, seq_lens, max_seq_len, defines, scale):
    """Split-K decode: `plan_decode` (knobs: `plan.DECODE_CONFIG`) picks the kernel variant and
    partitions; the reduce kernel merges the partitions when there are several."""
    num_seqs, num_q_heads, head_dim = q.shape
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode: {num_seqs} query rows for {seq_lens.shape[0]} sequences")
    num_kv_heads = k_cache.shape[2]
    q = q.contiguous() if q.data_ptr() % 16 == 0 else q.clone()  # 16-byte loads of q rows
    plan = plan_decode(num_seqs, num_kv_heads, max_seq_len, device_info(q.device).num_sms,
                       defines["GROUP_SIZE"], head_dim, defines["HERON_DTYPE"])
    defines = {**defines, **plan.defines}
    out = torch.empty_like(q)
    splits = plan.max_splits
    part_out = part_max = part_sum = None
    if splits > 1:
        part_out = torch.empty((num_seqs, num_q_heads, splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty((num_seqs, num_q_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    launch("attention_decode.cu", "paged_decode_kernel", defines,
           (splits, num_kv_heads, num_seqs), (plan.threads, 1, 1),
           (out, part_out, part_max, part_sum, q, k_cache, v_cache, *map(i64, strides),
            block_tables, i64(block_tables.stride(0)), seq_lens, i32(num_q_heads),
            i32(plan.partition_size), f32(scale * _LOG2E)), device=q.device)
    if splits > 1:
        threads = num_q_heads * head_dim // 4  # one per 4 output elements of a sequence
        launch("attention_decode.cu", "paged_decode_reduce_kernel", defines,
               (-(-threads // 128), num_seqs, 1), (128, 1, 1),
               (out, part_out, part_max, part_sum, seq_lens, i32(num_q_heads), i32(splits),
                i32(plan.partition_size)), device=q.device)
    return out


#: Which prefill kernel runs: "mma" (tensor cores, attention_prefill_mma.cu: float16 /
#: bfloat16 caches, head dims `plan.prefill_mma_supported` takes), "fma" (CUDA cores,
#: attention_prefill.cu: every dtype and head dim), "auto" (mma where supported, else fma),
#: or None: the environment variable HERON_PREFILL_KERNEL (fma|mma|auto), default auto.
#: Forcing "mma" where it is unsupported raises.
PREFILL_KERNEL: str | None = None
#: Force one tensor-core tile (`plan.MmaTile`) instead of `plan_prefill_mma`'s choice
#: (benchmarks and tests).
PREFILL_MMA_TILE: MmaTile | None = None


def prefill_kernel_choice() -> str:
    """"fma", "mma" or "auto": `PREFILL_KERNEL`, else $HERON_PREFILL_KERNEL, else "auto"."""
    choice = (PREFILL_KERNEL or os.environ.get("HERON_PREFILL_KERNEL") or "auto").lower()
    if choice not in ("fma", "mma", "auto"):
        raise ValueError("HERON_PREFILL_KERNEL / PREFILL_KERNEL must be fma, mma or auto, "
                         f"not {choice!r}")
    return choice


def _plan_mma(defines, head_dim, max_query_len, num_kv_heads, num_seqs, info, choice):
    """The tensor-core tile for this call, or None to run the fma kernel."""
    if choice == "fma":
        return None
    if not prefill_mma_supported(defines["HERON_DTYPE"], head_dim):
        if choice == "mma":
            raise ValueError("the mma prefill kernel takes float16/bfloat16 and head_dim a "
                             f"multiple of 16 <= {PREFILL_MMA_MAX_HEAD_DIM}; got dtype code "
                             f"{defines['HERON_DTYPE']}, head_dim {head_dim}")
        return None
    if PREFILL_MMA_TILE is not None:
        return PREFILL_MMA_TILE
    try:
        return plan_prefill_mma(head_dim, info.max_smem_per_block,
                                max_query_len * defines["GROUP_SIZE"], num_kv_heads * num_seqs,
                                info.num_sms)
    except ValueError:
        if choice == "mma":
            raise
        return None


def _prefill(q, k_cache, v_cache, strides, block_tables, seq_lens, query_start_loc,
             max_query_len, defines, scale):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = defines["GROUP_SIZE"]
    vec = vec_elems(q.dtype)
    if q.stride(-1) != 1 or q.stride(0) % vec or q.stride(1) % vec or q.data_ptr() % 16:
        q = q.contiguous()  # the kernels read q rows with 16-byte loads
    info = device_info(q.device)
    num_seqs = seq_lens.shape[0]
    tile = _plan_mma(defines, head_dim, max_query_len, num_kv_heads, num_seqs, info,
                     prefill_kernel_choice())
    if tile is not None:
        file, name, threads = "attention_prefill_mma.cu", "paged_prefill_mma_kernel", tile.threads
        block_m = tile.block_m
        smem = prefill_mma_smem_bytes(tile.block_m, tile.block_n, head_dim)
        defines = {**defines, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
                   "NUM_WARPS": tile.num_warps}
    else:
        if head_dim % 32:
            raise ValueError(f"the CUDA prefill attention kernel needs head_dim a multiple of 32 "
                             f"(the tensor-core one, HERON_PREFILL_KERNEL=auto, of 16); "
                             f"got {head_dim}")
        file, name, threads = "attention_prefill.cu", "paged_prefill_kernel", 128
        block_m, block_n = plan_prefill_tile(head_dim, info.max_smem_per_block)
        smem = prefill_smem_bytes(block_m, block_n, head_dim)
        defines = {**defines, "BLOCK_M": block_m, "BLOCK_N": block_n}
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    launch(file, name, defines,
           (-(-max_query_len * group // block_m), num_kv_heads, num_seqs), (threads, 1, 1),
           (out, q, i64(q.stride(0)), i64(q.stride(1)), k_cache, v_cache, *map(i64, strides),
            block_tables, i64(block_tables.stride(0)), seq_lens, query_start_loc,
            i32(num_q_heads), f32(scale * _LOG2E)), device=q.device, shared_mem=smem)
    return out
