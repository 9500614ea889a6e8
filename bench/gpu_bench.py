"""GPU microbenchmarks for one device session: bandwidth, matmul, heron's kernels vs torch.

Sections (``--only a,b``; default all): ``env``, ``bandwidth`` (device-to-device copy,
GB/s), ``matmul`` (bf16 8192^3, TFLOP/s), ``ops`` (norm / activation / rotary / KV write,
and rotary with the KV write, vs their torch references and their bytes), ``gemm`` (the decode step's projections at Llama-3-8B shapes, in
several cuBLAS layouts and libraries, vs their bytes' roofline), ``decode`` (paged decode attention at batch 1/16/64/256, 1k
context, and batch 16 at 4k, Llama-3-8B shapes, default plan, vs torch SDPA on contiguous
K/V and vs the HBM roofline), ``prefill`` (the
CUDA-core and tensor-core prefill kernels, and the tensor-core tiles, vs SDPA), ``mamba`` (the
hybrid family's SSD scan, state update and conv at Nemotron-H-8B shapes vs its torch
reference ops, decode vs the HBM roofline), ``decode_sweep``
(the decode kernel's tuning knobs, `plan.DecodeConfig`, at the same shapes: every kernel
variant x partition size, and the first kernel as a baseline; run last, so that a variant
that faults cannot take the other sections with it). A section that fails is recorded with its error
and the rest still run. Writes ``gpu_bench.json`` and ``gpu_bench.md`` to ``--out``
(default ``$OUT``, else bench/results/).

Kernel times are GPU time per call, measured by replaying a CUDA graph of ``GRAPH_CALLS``
calls (host launch overhead excluded); ``eager`` times include it (one call per event
pair). Run through bench/gpu.sh, which makes ``heron`` importable from the source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

GRAPH_CALLS = 20
#: Where the decode sections allocate (a CPU dry run of their plumbing can point it at "cpu").
DECODE_DEVICE = "cuda"
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, hidden=4096,
             intermediate=14336)


# ---------------------------------------------------------------------------- timing

_GEN: torch.Generator | None = None


def gen() -> torch.Generator:
    """The inputs' own CUDA generator: a graph capture that fails (`time_kernel` goes on
    after it) can leave the default one unusable ("Offset increment outside graph capture")."""
    global _GEN
    if _GEN is None:
        _GEN = torch.Generator(device="cuda").manual_seed(0)
    return _GEN



def time_eager(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median ms per call, one CUDA event pair around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def time_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Median GPU ms per call: a CUDA graph of GRAPH_CALLS calls, replayed ``reps`` times."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as graph capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return time_eager(graph.replay, warmup=2, reps=reps) / GRAPH_CALLS


def time_kernel(fn: Callable[[], object]) -> dict:
    """Graph time (falls back to eager when capture fails) and eager time, in ms."""
    out = {"eager_ms": time_eager(fn)}
    try:
        out["gpu_ms"] = time_graph(fn)
    except Exception as exc:  # report, do not hide: capture failing is itself a finding
        out["gpu_ms"] = out["eager_ms"]
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------- sections


def section_env(args) -> dict:
    import cupy

    props = torch.cuda.get_device_properties(0)
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cupy": cupy.__version__,
        "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        "device": props.name, "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
    }


def section_bandwidth(args) -> dict:
    nbytes = 2 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(generator=gen())
    b = torch.empty_like(a)
    ms = time_eager(lambda: b.copy_(a), reps=20)
    return {"copy_bytes": nbytes, "copy_ms": ms, "copy_gbps": 2 * nbytes / ms / 1e6}


def section_matmul(args) -> dict:
    n = 8192
    a = torch.randn(n, n, generator=gen(), device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen(), device="cuda", dtype=torch.bfloat16)
    ms = time_eager(lambda: a @ b, reps=20)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}


#: Llama-3-8B's projections, (in, out) of each weight [out, in]; per layer but lm_head.
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
         "lm_head": (4096, 128256)}
GEMM_ROWS = (1, 16, 64, 256)
#: Ways to compute x @ W.T: heron's F.linear on W [out, in] (cuBLAS "TN"), a matmul with the
#: weight stored transposed ([in, out]: "NN"), F.linear under each BLAS library torch has,
#: and F.linear under torch's TunableOp (each shape's algorithm picked by timing them all).
GEMM_VARIANTS = ("linear", "transposed", "linear-cublas", "linear-cublaslt", "linear-tunable")


def section_gemm(args, bandwidth_gbps: float) -> dict:
    """The decode step's GEMMs at Llama-3-8B shapes, bf16, at each of GEMM_ROWS rows, in each
    of GEMM_VARIANTS: GPU µs (graph replay, weights rotated past L2), x the bytes' roofline
    (weight + activations over the copy bandwidth). Then, per row count, a decode step's
    GEMM ms (32 layers + lm_head) for each variant, against the weights' roofline."""
    from torch.cuda import tunable

    backends = torch.backends.cuda
    default_lib = backends.preferred_blas_library()
    tunable.set_filename(os.path.join(tempfile.gettempdir(), "heron-tunableop.csv"))
    tunable.set_max_tuning_duration(200)  # ms per shape
    out: dict = {"default_blas": str(default_lib), "shapes": {}, "per_step_ms": {}}
    try:
        for name, (k, n) in GEMMS.items():
            nbytes = 2 * k * n
            sets = max(1, min(GRAPH_CALLS, -(-DECODE_ROTATE_BYTES // nbytes)))
            ws = [torch.randn(n, k, generator=gen(), device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(sets)]
            wts = [w.t().contiguous() for w in ws]
            for m in GEMM_ROWS:
                x = torch.randn(m, k, generator=gen(), device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x.float(), ws[0].float())
                roof_us = (nbytes + 2 * m * (k + n)) / bandwidth_gbps / 1e3
                row = out["shapes"].setdefault(f"{name} M={m}", {"roofline_us": roof_us})
                for variant in GEMM_VARIANTS:
                    if variant == "transposed":
                        fns = [lambda wt=wt: x @ wt for wt in wts]
                    else:
                        fns = [lambda w=w: F.linear(x, w) for w in ws]
                    lib = variant.partition("-")[2]
                    tuned = lib == "tunable"
                    try:
                        backends.preferred_blas_library(default_lib if tuned else lib or default_lib)
                        if tuned:  # tune eagerly (first call of the shape), replay the choice
                            tunable.enable(True)
                            tunable.tuning_enable(True)
                            fns[0]()
                            tunable.tuning_enable(False)
                        err = _rel_err(fns[0](), ref)
                        us = time_graph_rotating(fns) * 1e3
                        row[variant] = {"us": us, "x_roofline": us / roof_us, "rel_err": err}
                    except Exception as exc:  # a library torch lacks here
                        row[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    finally:
                        backends.preferred_blas_library(default_lib)
                        tunable.enable(False)
            del ws, wts
            torch.cuda.empty_cache()
    finally:
        backends.preferred_blas_library(default_lib)
    weights = sum(2 * k * n * (1 if name == "lm_head" else 32) for name, (k, n) in GEMMS.items())
    for m in GEMM_ROWS:
        step = {"weights_roofline_ms": weights / bandwidth_gbps / 1e6}
        for variant in GEMM_VARIANTS:
            runs = [(out["shapes"][f"{name} M={m}"].get(variant, {}), 1 if name == "lm_head" else 32)
                    for name in GEMMS]
            if all("us" in r for r, _ in runs):
                step[variant] = sum(r["us"] * times for r, times in runs) / 1e3
        out["per_step_ms"][m] = step
    return out


def _gemm_markdown(g: dict) -> list[str]:
    lines = [f"GEMMs of a Llama-3-8B decode step, bf16 (default BLAS {g['default_blas']}): µs and x "
             "the bytes' roofline, weights rotated past L2", "",
             "| GEMM | roofline µs | " + " | ".join(GEMM_VARIANTS) + " |",
             "|---|---|" + "---|" * len(GEMM_VARIANTS)]
    for name, row in g["shapes"].items():
        cells = [f"{row[v]['us']:.1f} ({row[v]['x_roofline']:.2f}x)" if "us" in row.get(v, {})
                 else "error" for v in GEMM_VARIANTS]
        lines.append(f"| {name} | {row['roofline_us']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| rows | weights roofline ms | " + " | ".join(GEMM_VARIANTS) + " |",
              "|---|---|" + "---|" * len(GEMM_VARIANTS)]
    for m, step in g["per_step_ms"].items():
        lines.append(f"| {m} | {step['weights_roofline_ms']:.2f} | "
                     + " | ".join(f"{step[v]:.2f}" if v in step else "-" for v in GEMM_VARIANTS) + " |")
    return lines + [""]


def section_ops(args) -> dict:
    from heron.core import ops
    from heron.core.ops import cuda as cuda_ops

    h, inter = LLAMA["hidden"], LLAMA["intermediate"]
    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    cs = ops.rope_cos_sin_cache(d, 8192, 500000.0).cuda()
    results = {}
    for t in (1, 64, 4096):
        x = torch.randn(t, h, generator=gen(), device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, generator=gen(), device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(t, 2 * inter, generator=gen(), device="cuda", dtype=torch.bfloat16)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen(), device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        pos = torch.randint(0, 8192, (t,), generator=gen(), device="cuda")
        cache = torch.zeros(2, t // 16 + 2, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(cache.shape[1] * 16, generator=gen(), device="cuda")[:t]
        row, qk, kv = t * h * 2, t * (hq + hkv) * d * 2, t * hkv * d * 2  # bytes
        pairs = {  # name: (heron, torch, bytes read and written)
            "rms_norm+residual": (lambda: cuda_ops.rms_norm(x, w, 1e-5, x),
                                  lambda: ops.rms_norm_ref(x, w, 1e-5, x), 4 * row),
            "silu_and_mul": (lambda: cuda_ops.silu_and_mul(gu), lambda: ops.silu_and_mul_ref(gu),
                             3 * t * inter * 2),
            "rotary": (lambda: cuda_ops.rotary(q, k, pos, cs), lambda: ops.rotary_ref(q, k, pos, cs),
                       2 * qk),
            "write_kv": (lambda: cuda_ops.write_kv(k, v, cache[0], cache[1], slots),
                         lambda: ops.write_kv_ref(k, v, cache[0], cache[1], slots), 4 * kv),
            "rotary_write_kv": (
                lambda: cuda_ops.rotary_write_kv(q, k, v, pos, cs, cache[0], cache[1], slots),
                lambda: ops.rotary_write_kv_ref(q, k, v, pos, cs, cache[0], cache[1], slots),
                2 * qk + 2 * kv),
        }
        for name, (heron_fn, ref_fn, nbytes) in pairs.items():
            results[f"{name} T={t}"] = {"heron": time_kernel(heron_fn), "torch": time_kernel(ref_fn),
                                        "bytes": nbytes}
    return results


def _paged_kv(num_seqs: int, context: int, dtype=torch.bfloat16, sets: int = 1):
    """A shuffled paged cache holding ``sets`` x ``num_seqs`` contexts, and one decode
    metadata per set (disjoint blocks): rotating among sets keeps small batches out of L2."""
    from heron.core.batch import AttentionMetadata

    bs, hkv, d = LLAMA["block_size"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    per_seq = -(-context // bs)
    num_blocks = sets * num_seqs * per_seq + 1
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=gen(), device=DECODE_DEVICE, dtype=dtype)
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen(), device=DECODE_DEVICE)).view(sets, num_seqs, per_seq).int()
    metas = []
    for tables in ids:
        metas.append(AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=DECODE_DEVICE),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DECODE_DEVICE),
            seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=DECODE_DEVICE),
            block_tables=tables.contiguous(), query_lens_list=[1] * num_seqs,
            seq_lens_list=[context] * num_seqs, max_query_len=1, max_seq_len=context,
            block_size=bs))
    return kv, metas


#: (batch, context) of the decode measurements, Llama-3-8B attention shapes.
#: (batch, context); 64 x 1088 is the end-to-end run's batch-64 step (a context just past a
#: 1024-key partition).
DECODE_SHAPES = ((1, 1024), (16, 1024), (64, 1024), (64, 1088), (256, 1024), (16, 4096))
#: Rotate among enough KV sets that one graph replay streams at least this many bytes (L2 is
#: 50 MB on H100/H200): a real decode step reads each layer's KV after the other layers'.
DECODE_ROTATE_BYTES = 160 << 20


def _decode_setup(batch: int, context: int):
    """KV sets, a query, the SDPA reference output (set 0) and the KV bytes of one call."""
    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    kv_bytes = 2 * batch * context * hkv * d * 2
    sets = max(1, min(GRAPH_CALLS, -(-DECODE_ROTATE_BYTES // kv_bytes)))
    kv, metas = _paged_kv(batch, context, sets=sets)
    q = torch.randn(batch, hq, d, generator=gen(), device=DECODE_DEVICE, dtype=torch.bfloat16)
    tables = metas[0].block_tables.long()
    k = kv[0][tables].view(batch, -1, hkv, d)[:, :context].transpose(1, 2).contiguous()
    v = kv[1][tables].view(batch, -1, hkv, d)[:, :context].transpose(1, 2).contiguous()
    return kv, metas, q, (k, v), kv_bytes


def time_graph_rotating(fns: list[Callable[[], object]], reps: int = 20) -> float:
    """Like `time_graph`, the GRAPH_CALLS calls of the graph cycling through ``fns``."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fns[0]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fns[i % len(fns)]()
    ms = time_eager(graph.replay, warmup=2, reps=reps) / GRAPH_CALLS
    del graph
    return ms


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def section_decode(args, bandwidth_gbps: float | None) -> dict:
    """The default plan at each of DECODE_SHAPES (the numbers the engine gets)."""
    from heron.core.ops import cuda as cuda_ops
    from heron.core.ops.cuda import plan

    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    scale = d ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    for batch, context in DECODE_SHAPES:
        kv, metas, q, (k, v), kv_bytes = _decode_setup(batch, context)
        fns = [lambda m=m: cuda_ops.paged_attention(q, kv[0], kv[1], m, scale) for m in metas]
        heron = {"eager_ms": time_eager(fns[0]), "gpu_ms": time_graph_rotating(fns)}
        q4 = q.unsqueeze(2)
        sdpa_fn = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
        sdpa = time_kernel(sdpa_fn)
        p = plan.plan_decode(batch, hkv, context, sms, hq // hkv, d, 2)
        row = {"heron": heron, "sdpa_contiguous": sdpa, "kv_bytes": kv_bytes, "kv_sets": len(metas),
               "plan": {"partition_size": p.partition_size, "splits": p.max_splits, **p.defines},
               "rel_err_vs_sdpa": _rel_err(fns[0](), sdpa_fn().squeeze(2)),
               "heron_gbps": kv_bytes / heron["gpu_ms"] / 1e6}
        if bandwidth_gbps:
            roofline_ms = kv_bytes / bandwidth_gbps / 1e6
            row["roofline_ms"] = roofline_ms
            row["x_roofline"] = heron["gpu_ms"] / roofline_ms
        results[f"batch {batch}" if context == 1024 else f"batch {batch} ctx {context}"] = row
        del kv, metas, k, v
        torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------- decode sweep

#: Compile-time variants of attention_decode.cu swept (plan.DecodeConfig fields); each is
#: crossed with every partition size of DECODE_PARTITIONS and with the plan's own choice at
#: each of DECODE_CTAS_PER_SM.
DECODE_VARIANTS = {  # most important first: a sweep over its time budget drops the tail
    "mma": dict(kernel="mma"),
    "fma": dict(kernel="fma"),
    "mma-w8": dict(kernel="mma", warps=8),
    "mma-w2": dict(kernel="mma", warps=2),
    "mma-prefetch": dict(kernel="mma", prefetch=True),
    "mma-minblocks3": dict(kernel="mma", min_blocks=3),
    "mma-u2": dict(kernel="mma", unroll=2),
    "fma-u2": dict(kernel="fma", unroll=2),
    "fma-prefetch": dict(kernel="fma", prefetch=True),
    "fma-u8": dict(kernel="fma", unroll=8),
    "fma-lanes8-u2": dict(kernel="fma", key_lanes=8, unroll=2),
}
#: Forced partition sizes (keys per CTA) per (batch, context).
DECODE_PARTITIONS = {
    (1, 1024): (16, 32, 64, 128, 256),
    (16, 1024): (64, 128, 256, 512, 1024),
    (64, 1024): (128, 256, 512, 1024),
    (64, 1088): (256, 512, 1024, 1152, 2048),
    (256, 1024): (256, 512, 1024),
    (16, 4096): (256, 512, 1024, 2048, 4096),
}
DECODE_CTAS_PER_SM = (1, 2, 4, 8)
#: The plan's bounds on a partition (`plan.DecodeConfig.max_partition`) fitted with it.
DECODE_MAX_PARTITIONS = (1024, 2048, 4096)
#: A variant whose output is further than this from SDPA's (relative norm) is flagged wrong.
DECODE_ERR_LIMIT = 2e-2
#: Seconds the sweep may take, compiles included ($HERON_SWEEP_BUDGET_S overrides); past it
#: the remaining timings are skipped (marked), so the results are still written.
DECODE_SWEEP_BUDGET_S = 50.0


def _precompile_decode(configs: list[dict]) -> dict:
    """Compile every decode variant in parallel threads (NVRTC releases the GIL) into cupy's
    disk cache, with the very text and options `heron.core.kernels.get_kernel` uses, so the
    sweep's first launches only load. {variant name: error} for those that failed (the sweep
    still tries them: a failure here may be the threads', not the variant's)."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy

    from heron.core.kernels import compile_options, load_source
    from heron.core.ops.cuda import plan
    from heron.core.ops.cuda.launch import KERNEL_DIR

    text = load_source(KERNEL_DIR / "attention_decode.cu")
    base = {"HERON_DTYPE": 2, "HEAD_DIM": LLAMA["head_dim"], "BLOCK_SIZE": LLAMA["block_size"],
            "GROUP_SIZE": LLAMA["num_q_heads"] // LLAMA["num_kv_heads"]}

    def build(item):
        name, config = item
        p = plan.plan_decode(1, 8, 1024, 132, base["GROUP_SIZE"], base["HEAD_DIM"], 2,
                             plan.DecodeConfig(**config))
        try:
            module = cupy.RawModule(code=text, options=compile_options({**base, **p.defines}))
            module.get_function("paged_decode_kernel")
            return name, None
        except Exception as exc:  # the sweep reports it per variant
            return name, f"{type(exc).__name__}: {exc}"[-1500:]

    with ThreadPoolExecutor(max_workers=min(16, len(configs))) as pool:
        return {n: e for n, e in pool.map(build, configs) if e}


def _decode_v1(q, kv, meta, scale, sms):
    """The first decode kernel (bench/decode_v1) with its own plan: 2 CTAs per SM, partitions
    a power of two in 64..512, PARTITION_MAX 512, 128 threads."""
    import math

    from heron.core.ops.cuda.launch import f32, i32, i64, launch

    path = str(Path(__file__).resolve().parent / "decode_v1" / "attention_decode_v1.cu")
    num_seqs, hq, d = q.shape
    hkv = kv.shape[3]
    ctx = meta.max_seq_len
    splits_wanted = max(1, math.ceil(2 * sms / (num_seqs * hkv)))
    size = 1 << max(0, math.ceil(ctx / splits_wanted) - 1).bit_length()
    size = min(max(size, 64), 512)
    splits = math.ceil(ctx / size)
    defines = {"HERON_DTYPE": 2, "HEAD_DIM": d, "GROUP_SIZE": hq // hkv,
               "BLOCK_SIZE": kv.shape[2], "PARTITION_MAX": 512}
    out = torch.empty_like(q)
    po = torch.empty((num_seqs, hq, splits, d), dtype=torch.float32, device=q.device)
    pm = torch.empty((num_seqs, hq, splits), dtype=torch.float32, device=q.device)
    ps = torch.empty_like(pm)
    k_cache, v_cache = kv[0], kv[1]
    strides = [i64(x) for x in k_cache.stride()[:3]]
    launch(path, "paged_decode_kernel", defines, (splits, hkv, num_seqs), (128, 1, 1),
           (out, po, pm, ps, q, k_cache, v_cache, *strides, meta.block_tables,
            i64(meta.block_tables.stride(0)), meta.seq_lens, i32(hq), i32(size),
            f32(scale * math.log2(math.e))), device=q.device)
    if splits > 1:
        launch(path, "paged_decode_reduce_kernel", defines, (hq, num_seqs, 1), (128, 1, 1),
               (out, po, pm, ps, meta.seq_lens, i32(hq), i32(splits), i32(size)), device=q.device)
    return out


def section_decode_sweep(args, bandwidth_gbps: float | None) -> dict:
    """Every DECODE_VARIANTS kernel x partition size (forced, and the plan's choice at each
    DECODE_CTAS_PER_SM) at each of DECODE_SHAPES: GPU µs (CUDA-graph replay, KV sets rotated
    past L2), KV GB/s, x roofline, error vs SDPA. Compiles happen first, outside timing.
    Variants run in DECODE_VARIANTS order over all shapes (all KV resident: ~2 GB), so a
    sweep cut short by its budget loses the least important variants."""
    from heron.core.ops import cuda as cuda_ops
    from heron.core.ops.cuda import plan

    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    scale = d ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    budget = float(os.environ.get("HERON_SWEEP_BUDGET_S") or DECODE_SWEEP_BUDGET_S)
    t0 = time.perf_counter()
    compile_errors = _precompile_decode(list(DECODE_VARIANTS.items()))
    out = {"compile_s": time.perf_counter() - t0, "compile_errors": compile_errors, "shapes": {}}
    setups = {}
    for batch, context in DECODE_SHAPES:
        kv, metas, q, (k, v), kv_bytes = _decode_setup(batch, context)
        ref = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                             enable_gqa=True).squeeze(2)
        del k, v
        setups[(batch, context)] = (kv, metas, q, ref)
        out["shapes"][f"{batch}x{context}"] = {
            "kv_bytes": kv_bytes, "kv_sets": len(metas), "runs": {}, "plans": {},
            "roofline_ms": kv_bytes / bandwidth_gbps / 1e6 if bandwidth_gbps else None}
    torch.cuda.synchronize()

    def measure(shape, ref, label, fns):
        if time.perf_counter() - t0 > budget:
            shape["runs"][label] = {"error": "skipped: sweep time budget spent"}
            return
        try:
            err = _rel_err(fns[0](), ref)
            ms = time_graph_rotating(fns, reps=10)
            run = {"us": ms * 1e3, "gbps": shape["kv_bytes"] / ms / 1e6, "rel_err": err,
                   "x_roofline": ms / shape["roofline_ms"] if shape["roofline_ms"] else None}
            if not err <= DECODE_ERR_LIMIT:  # NaN too
                run["wrong"] = True
        except Exception as exc:  # report and go on: one bad variant must not end the sweep
            run = {"error": f"{type(exc).__name__}: {exc}"[-600:]}
        shape["runs"][label] = run

    for (batch, context), (kv, metas, q, ref) in setups.items():
        measure(out["shapes"][f"{batch}x{context}"], ref, "v1",
                [lambda kv=kv, m=m, q=q: _decode_v1(q, kv, m, scale, sms) for m in metas])
    for name, config in DECODE_VARIANTS.items():  # a precompile error is retried here
        for (batch, context), (kv, metas, q, ref) in setups.items():
            shape = out["shapes"][f"{batch}x{context}"]
            sizes = set(DECODE_PARTITIONS[(batch, context)])
            for ctas in DECODE_CTAS_PER_SM:
                for max_partition in DECODE_MAX_PARTITIONS:
                    p = plan.plan_decode(batch, hkv, context, sms, hq // hkv, d, 2, plan.DecodeConfig(
                        **config, ctas_per_sm=ctas, max_partition=max_partition))
                    shape["plans"][_plan_key(name, ctas, max_partition)] = p.partition_size
                    sizes.add(p.partition_size)
            for size in sorted(sizes):
                with plan.decode_config(plan.DecodeConfig(**config, partition_size=size)):
                    measure(shape, ref, f"{name} P={size}", [
                        lambda kv=kv, m=m, q=q: cuda_ops.paged_attention(q, kv[0], kv[1], m, scale)
                        for m in metas])
    for shape in out["shapes"].values():
        ok = {lbl: r for lbl, r in shape["runs"].items() if "us" in r and not r.get("wrong")}
        if ok:
            best = min(ok, key=lambda lbl: ok[lbl]["us"])
            shape["best"] = {"label": best, **ok[best]}
    del setups
    torch.cuda.empty_cache()
    out["recommended"] = _recommend(out["shapes"])
    out["total_s"] = time.perf_counter() - t0
    return out


def _plan_key(name: str, ctas: int, max_partition: int) -> str:
    """The label of a variant's planned partition size; the plan's default bound omitted."""
    from heron.core.ops.cuda import plan

    bound = "" if max_partition == plan.MAX_PARTITION else f" max_partition={max_partition}"
    return f"{name} ctas_per_sm={ctas}{bound}"


def _recommend(shapes: dict) -> dict:
    """The variant with the best geometric mean of (its best time / the best time) over the
    shapes, each shape at its best partition size, and its per-shape best partition; then
    the plan knobs (ctas_per_sm, max_partition) whose own partitions of it came closest."""
    import math

    def geomean(ratios):
        return math.exp(sum(map(math.log, ratios)) / len(ratios))

    scores = {}
    for name in DECODE_VARIANTS:
        ratios, sizes = [], {}
        for key, shape in shapes.items():
            runs = {lbl: r for lbl, r in shape["runs"].items()
                    if lbl.startswith(name + " P=") and "us" in r and not r.get("wrong")}
            if not runs or "best" not in shape:
                break
            lbl = min(runs, key=lambda x: runs[x]["us"])
            ratios.append(runs[lbl]["us"] / shape["best"]["us"])
            sizes[key] = int(lbl.split("P=")[1])
        else:
            scores[name] = {"geomean_x_best": geomean(ratios), "best_partition": sizes}
    if not scores:
        return {}
    name = min(scores, key=lambda n: scores[n]["geomean_x_best"])

    def planned(ctas, max_partition):  # the variant at the plan's own partitions
        ratios = []
        for shape in shapes.values():
            size = shape["plans"].get(_plan_key(name, ctas, max_partition))
            run = shape["runs"].get(f"{name} P={size}", {})
            if "us" not in run or run.get("wrong"):
                return None
            ratios.append(run["us"] / shape["best"]["us"])
        return geomean(ratios)

    fits = {(c, m): r for c in DECODE_CTAS_PER_SM for m in DECODE_MAX_PARTITIONS
            if (r := planned(c, m)) is not None}
    fitted = {}
    if fits:
        ctas, max_partition = min(fits, key=fits.get)
        fitted = {"ctas_per_sm": ctas, "max_partition": max_partition,
                  "planned_geomean_x_best": {f"ctas_per_sm={c} max_partition={m}": round(r, 3)
                                             for (c, m), r in fits.items()}}
    return {"variant": name, "config": DECODE_VARIANTS[name], **scores[name], **fitted,
            "all": {n: round(s["geomean_x_best"], 3) for n, s in scores.items()}}


#: Tensor-core prefill tiles (BLOCK_M, BLOCK_N, NUM_WARPS) timed on the 4k prompt; the plan's
#: default (plan.PREFILL_MMA_TILES[0]) is one of them.
PREFILL_MMA_SWEEP = ((128, 64, 4), (128, 64, 8), (64, 64, 4), (64, 32, 4))
#: Prefill cases: name -> (query_lens, seq_lens). The first is the headline number.
PREFILL_CASES = {
    "4096 causal": ([4096], [4096]),
    "8 x 512 causal": ([512] * 8, [512] * 8),
    "512-token chunk over 3584 cached": ([512], [4096]),
}


def _prefill_inputs(query_lens: list[int], seq_lens: list[int], dtype=torch.bfloat16):
    """Llama-3-8B attention over a shuffled paged cache: q, k_cache, v_cache, metadata, and
    the SDPA reference output on contiguous K/V ([T, Hq, D])."""
    from heron.core.batch import AttentionMetadata

    hq, hkv, d, bs = (LLAMA[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"))
    per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=gen(), device="cuda", dtype=dtype)
    perm = (1 + torch.randperm(num_blocks - 1, generator=gen(), device="cuda")).int()
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda"),
        query_start_loc=qsl.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables, query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs)
    q = torch.randn(sum(query_lens), hq, d, generator=gen(), device="cuda", dtype=dtype)
    scale = d ** -0.5
    refs, sdpa_fns = [], []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        blocks = tables[i, :per_seq[i]].long()
        k = kv[0][blocks].reshape(1, -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        v = kv[1][blocks].reshape(1, -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        qi = q[int(qsl[i]):int(qsl[i + 1])].transpose(0, 1).unsqueeze(0)
        if ql == sl:
            fn = (lambda qi=qi, k=k, v=v: F.scaled_dot_product_attention(
                qi, k, v, is_causal=True, scale=scale, enable_gqa=True))
        else:
            mask = (torch.arange(sl, device="cuda")[None, :]
                    <= torch.arange(ql, device="cuda")[:, None] + (sl - ql))
            fn = (lambda qi=qi, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
        sdpa_fns.append(fn)
        refs.append(fn()[0].transpose(0, 1))
    return q, kv, meta, torch.cat(refs), sdpa_fns


def _prefill_flops(query_lens, seq_lens) -> float:
    """QK^T and PV over the visible (causal) keys: 4 * Hq * D per (query, key) pair."""
    pairs = sum(ql * (sl - ql) + ql * (ql + 1) / 2 for ql, sl in zip(query_lens, seq_lens))
    return 4 * LLAMA["num_q_heads"] * LLAMA["head_dim"] * pairs


def section_prefill(args) -> dict:
    """Prefill attention, Llama-3-8B shapes, bf16: the CUDA-core kernel (fma), the tensor-core
    kernel (mma) with the plan's tile and, on the 4k prompt, each tile of PREFILL_MMA_SWEEP;
    torch SDPA on contiguous K/V for reference. GPU time from CUDA-graph replays."""
    from heron.core.ops import cuda as cuda_ops
    from heron.core.ops.cuda import attention
    from heron.core.ops.cuda.plan import MmaTile

    scale = LLAMA["head_dim"] ** -0.5
    out: dict = {"cases": {}}
    for case_name, (qlens, slens) in PREFILL_CASES.items():
        q, kv, meta, ref, sdpa_fns = _prefill_inputs(qlens, slens)
        flops = _prefill_flops(qlens, slens)
        sdpa = time_kernel(lambda: [fn() for fn in sdpa_fns])
        row = {"flops": flops, "sdpa_contiguous": sdpa, "sdpa_tflops": flops / sdpa["gpu_ms"] / 1e9,
               "kernels": {}}
        variants = [("fma", "fma", None), ("mma", "mma", None)]
        if case_name == "4096 causal":
            variants += [(f"mma {bm}x{bn}x{w}", "mma", (bm, bn, w))
                         for bm, bn, w in PREFILL_MMA_SWEEP]
        for label, kernel, tile in variants:
            attention.PREFILL_KERNEL = kernel
            attention.PREFILL_MMA_TILE = MmaTile(*tile) if tile else None
            try:
                fn = lambda: cuda_ops.paged_attention(q, kv[0], kv[1], meta, scale)  # noqa: E731
                got = fn()
                err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
                t = time_kernel(fn)
                row["kernels"][label] = {**t, "tflops": flops / t["gpu_ms"] / 1e9,
                                         "rel_err_vs_sdpa": err,
                                         "nan": bool(torch.isnan(got).any())}
            except Exception as exc:  # one failing variant must not hide the others
                row["kernels"][label] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                attention.PREFILL_KERNEL = attention.PREFILL_MMA_TILE = None
        out["cases"][case_name] = row
        del q, kv, meta, ref, sdpa_fns
        torch.cuda.empty_cache()
    # The headline keys of earlier runs: the 4k prompt, the engine's default path (mma).
    first = out["cases"]["4096 causal"]
    default = first["kernels"].get("mma", {})
    if "gpu_ms" in default:
        out.update(tokens=4096, heron={"eager_ms": default["eager_ms"], "gpu_ms": default["gpu_ms"]},
                   sdpa_contiguous=first["sdpa_contiguous"], heron_tflops=default["tflops"],
                   sdpa_tflops=first["sdpa_tflops"])
    return out


def _prefill_markdown(p: dict) -> list[str]:
    lines = ["Prefill attention, Llama-3-8B shapes (32q/8kv heads, d128, bf16, block 16); GPU ms "
             "from graph replays, rel err vs SDPA", "",
             "| case | kernel | ms | TFLOP/s | rel err |", "|---|---|---|---|---|"]
    for name, row in p.get("cases", {}).items():
        lines.append(f"| {name} | SDPA contiguous | {row['sdpa_contiguous']['gpu_ms']:.3f} | "
                     f"{row['sdpa_tflops']:.0f} | - |")
        for label, r in row["kernels"].items():
            if "error" in r:
                lines.append(f"| {name} | {label} | error: {r['error'][:120]} | | |")
            else:
                lines.append(f"| {name} | {label} | {r['gpu_ms']:.3f} | {r['tflops']:.0f} | "
                             f"{r['rel_err_vs_sdpa']:.1e}{' NaN!' if r['nan'] else ''} |")
    return lines + [""]


# Nemotron-H-8B's Mamba2 layers: d_inner 8192 (128 heads of 64), 8 groups, state 128
MAMBA = dict(heads=128, head_dim=64, groups=8, state_size=128, chunk_size=128, conv_width=4)
MAMBA_PREFILL_CASES = {"4096": [4096], "4 x 1024": [1024] * 4}


def _mamba_inputs(num_rows: int, num_slots: int, dtype=torch.bfloat16):
    """The SSM ops' inputs as the mixer passes them (x, B, C column views of one conv
    output; dt, A, D, state float32): ``(inputs, state)``."""
    h, p, g, n = (MAMBA[k] for k in ("heads", "head_dim", "groups", "state_size"))
    conv_out = torch.randn(num_rows, h * p + 2 * g * n, generator=gen(), device="cuda", dtype=dtype)
    x, B, C = conv_out.split([h * p, g * n, g * n], dim=-1)
    inputs = dict(x=x.view(num_rows, h, p), B=B.view(num_rows, g, n), C=C.view(num_rows, g, n),
                  dt=F.softplus(torch.randn(num_rows, h, generator=gen(), device="cuda") - 1),
                  A=-torch.exp(torch.randn(h, generator=gen(), device="cuda") * 0.5),
                  D=torch.randn(h, generator=gen(), device="cuda"))
    return inputs, torch.randn(num_slots, h, p, n, generator=gen(), device="cuda") * 0.1


def _float(inputs: dict) -> dict:
    return {k: v.float() for k, v in inputs.items()}


def section_mamba(args, bandwidth_gbps: float) -> dict:
    """The hybrid family's Mamba2 kernels at Nemotron-H-8B shapes, bf16 (states float32),
    vs the family's torch reference ops (float32) on the same GPU: the chunked SSD scan of
    prefill; the decode state update and conv at batch 64 and 256, against the HBM roofline
    (a decode step reads and writes each sequence's state once)."""
    from heron.plugins.hybrid_ssm import cuda as mamba_cuda
    from heron.plugins.hybrid_ssm import ops

    out: dict = {"prefill": {}, "decode": {}}
    chunk = MAMBA["chunk_size"]
    for name, lens in MAMBA_PREFILL_CASES.items():
        seqs, row = [], 0
        for slot, n in enumerate(lens):
            seqs.append((row, row + n, slot))
            row += n
        t, state = _mamba_inputs(row, len(lens))
        ref_t, ref_state = _float(t), state.clone()
        y_ref = ops.ssd_prefill_ref(**ref_t, chunk_size=chunk, seqs=seqs, ssm_state=ref_state)
        y = mamba_cuda.ssd_prefill(**t, chunk_size=chunk, seqs=seqs, ssm_state=state.clone())
        heron = time_kernel(lambda: mamba_cuda.ssd_prefill(**t, chunk_size=chunk, seqs=seqs,
                                                           ssm_state=state))
        ref = time_kernel(lambda: ops.ssd_prefill_ref(**ref_t, chunk_size=chunk, seqs=seqs,
                                                      ssm_state=ref_state))
        out["prefill"][name] = {"tokens": row, "heron": heron, "torch": ref,
                                "tokens_per_s": row / heron["gpu_ms"] * 1e3,
                                "speedup": ref["gpu_ms"] / heron["gpu_ms"],
                                "rel_err": _rel_err(y, y_ref)}
    h, p, n = MAMBA["heads"], MAMBA["head_dim"], MAMBA["state_size"]
    conv_dim, width = h * p + 2 * MAMBA["groups"] * n, MAMBA["conv_width"]
    for batch in (64, 256):
        t, state = _mamba_inputs(batch, batch)
        slots = torch.randperm(batch, generator=gen(), device="cuda")
        ref_t = _float(t)
        heron = time_kernel(lambda: mamba_cuda.ssm_decode(**t, ssm_state=state, slots=slots))
        ref = time_kernel(lambda: ops.ssm_decode_ref(**ref_t, ssm_state=state, slots=slots))
        state_bytes = 2 * batch * h * p * n * 4
        out["decode"][f"ssm_decode B={batch}"] = {
            "heron": heron, "torch": ref, "speedup": ref["gpu_ms"] / heron["gpu_ms"],
            "state_gbps": state_bytes / heron["gpu_ms"] / 1e6,
            "x_roofline": heron["gpu_ms"] / (state_bytes / bandwidth_gbps / 1e6)}
        x = torch.randn(batch, conv_dim, generator=gen(), device="cuda", dtype=torch.bfloat16)
        window = torch.randn(batch, conv_dim, width - 1, generator=gen(), device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(conv_dim, width, generator=gen(), device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(conv_dim, generator=gen(), device="cuda", dtype=torch.bfloat16)
        heron = time_kernel(lambda: mamba_cuda.conv1d_decode(x, window, slots, weight, bias))
        ref = time_kernel(lambda: ops.conv1d_decode_ref(x, window, slots, weight, bias))
        out["decode"][f"conv1d_decode B={batch}"] = {
            "heron": heron, "torch": ref, "speedup": ref["gpu_ms"] / heron["gpu_ms"]}
    return out


def _mamba_markdown(m: dict) -> list[str]:
    lines = ["Mamba2 kernels, Nemotron-H-8B shapes (128 heads x 64, 8 groups, state 128, bf16), "
             "vs the torch reference ops (float32), GPU ms", "",
             "| op | heron ms | torch ms | speedup | |", "|---|---|---|---|---|"]
    for name, r in m.get("prefill", {}).items():
        lines.append(f"| ssd_prefill {name} | {r['heron']['gpu_ms']:.3f} | {r['torch']['gpu_ms']:.3f} "
                     f"| {r['speedup']:.1f}x | {r['tokens_per_s']:.3g} tok/s, rel err "
                     f"{r['rel_err']:.1e} |")
    for name, r in m.get("decode", {}).items():
        extra = (f"{r['state_gbps']:.0f} GB/s, {r['x_roofline']:.2f}x roofline"
                 if "state_gbps" in r else "")
        lines.append(f"| {name} | {r['heron']['gpu_ms']:.4f} | {r['torch']['gpu_ms']:.4f} | "
                     f"{r['speedup']:.1f}x | {extra} |")
    return lines + [""]


SECTIONS = ["env", "bandwidth", "matmul", "ops", "gemm", "decode", "prefill", "mamba", "decode_sweep"]


# ---------------------------------------------------------------------------- report


def _sweep_cell(r: dict | None, best: str | None, label: str) -> str:
    if r is None:
        return ""
    if "error" in r:
        return "err"
    cell = f"{r['us']:.1f}" + ("!" if r.get("wrong") else "")
    return f"**{cell}**" if label == best else cell


def _sweep_markdown(sweep: dict) -> list[str]:
    """Per shape a variant x partition matrix of µs (bold: the shape's best; ! = wrong result,
    err = failed), then the summary: best per shape vs the first kernel and the default plan."""
    lines = [f"## Decode sweep: µs per call (CUDA-graph replay, KV sets rotated past L2); "
             f"compile {sweep.get('compile_s', 0):.1f} s, total {sweep.get('total_s', 0):.1f} s", ""]
    if sweep.get("compile_errors"):
        lines += [f"compile errors: {sorted(sweep['compile_errors'])}", ""]
    summary = ["| shape | best | µs | GB/s | x roofline | v1 µs | best / v1 |", "|---|---|---|---|---|---|---|"]
    for key, shape in sweep["shapes"].items():
        runs, best = shape["runs"], shape.get("best", {}).get("label")
        sizes = sorted({int(lbl.split("P=")[1]) for lbl in runs if " P=" in lbl})
        roof = shape.get("roofline_ms")
        lines += [f"### {key}: KV {shape['kv_bytes'] / 1e6:.1f} MB, {shape['kv_sets']} set(s), roofline "
                  f"{roof * 1e3:.2f} µs" if roof else f"### {key}", "",
                  "| variant | " + " | ".join(f"P={p}" for p in sizes) + " | plan P at ctas/SM 1/2/4/8 |",
                  "|---|" + "---|" * (len(sizes) + 1)]
        v1 = runs.get("v1", {})
        lines.append(f"| v1 (own plan) | {_sweep_cell(v1, best, 'v1')} |" + " |" * len(sizes))
        for name in DECODE_VARIANTS:
            cells = [_sweep_cell(runs.get(f"{name} P={p}"), best, f"{name} P={p}") for p in sizes]
            plans = "/".join(str(shape["plans"].get(f"{name} ctas_per_sm={c}", "-")) for c in DECODE_CTAS_PER_SM)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {plans} |")
        lines.append("")
        b = shape.get("best")
        if b:
            ratio = b["us"] / v1["us"] if "us" in v1 else float("nan")
            summary.append(f"| {key} | {b['label']} | {b['us']:.1f} | {b['gbps']:.0f} | "
                           f"{(b.get('x_roofline') or float('nan')):.2f} | {v1.get('us', float('nan')):.1f} | {ratio:.2f} |")
    rec = sweep.get("recommended", {})
    lines += ["### Decode sweep summary", ""] + summary + [""]
    if rec:
        lines += [f"Recommended variant: `{rec['variant']}` {rec['config']} at {rec['geomean_x_best']:.3f}x "
                  f"the per-shape best (geomean); its best partition per shape: {rec['best_partition']}",
                  f"All variants (geomean x best): {rec['all']}", ""]
    return lines


def markdown(results: dict) -> str:
    lines = ["# heron GPU microbenchmarks", ""]
    env = results.get("env", {})
    if "device" in env:
        lines += [f"{env['device']} ({env['sms']} SMs, {env['memory_gib']} GiB), torch "
                  f"{env['torch']} (CUDA {env['torch_cuda']}), cupy {env['cupy']}", ""]
    if "copy_gbps" in results.get("bandwidth", {}):
        lines.append(f"- device copy bandwidth: {results['bandwidth']['copy_gbps']:.0f} GB/s")
    if "tflops" in results.get("matmul", {}):
        lines.append(f"- bf16 matmul 8192^3: {results['matmul']['tflops']:.0f} TFLOP/s")
    lines.append("")
    if isinstance(results.get("ops"), dict) and "error" not in results["ops"]:
        gbps = results.get("bandwidth", {}).get("copy_gbps", float("nan"))
        lines += ["Ops (repeated in a graph: small T stays in L2; the roofline is the bytes at "
                  "the copy bandwidth)", "",
                  "| op | heron µs (gpu / eager) | torch µs (gpu / eager) | roofline µs |",
                  "|---|---|---|---|"]
        for name, r in results["ops"].items():
            h, t = r["heron"], r["torch"]
            lines.append(f"| {name} | {h['gpu_ms']*1e3:.1f} / {h['eager_ms']*1e3:.1f} | "
                         f"{t['gpu_ms']*1e3:.1f} / {t['eager_ms']*1e3:.1f} | "
                         f"{r.get('bytes', float('nan')) / gbps / 1e3:.1f} |")
        lines.append("")
    if isinstance(results.get("gemm"), dict) and "error" not in results["gemm"]:
        lines += _gemm_markdown(results["gemm"])
    if isinstance(results.get("decode"), dict) and "error" not in results["decode"]:
        lines += ["Decode attention, default plan, Llama-3-8B shapes (32q/8kv heads, d128, bf16, block 16); "
                  "KV sets rotated past L2", "",
                  "| batch | heron µs | heron eager µs | KV GB/s | x roofline | SDPA contiguous µs | plan | err vs SDPA |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in results["decode"].items():
            pl = r.get("plan", {})
            kind = "mma" if pl.get("DECODE_MMA") else "fma"
            lines.append(f"| {name[6:]} | {r['heron']['gpu_ms']*1e3:.1f} | {r['heron']['eager_ms']*1e3:.1f} | "
                         f"{r['heron_gbps']:.0f} | {r.get('x_roofline', float('nan')):.2f} | "
                         f"{r['sdpa_contiguous']['gpu_ms']*1e3:.1f} | {kind} P={pl.get('partition_size')} "
                         f"x{pl.get('splits')} w{pl.get('DECODE_WARPS')} | {r.get('rel_err_vs_sdpa', float('nan')):.1e} |")
        lines.append("")
    p = results.get("prefill", {})
    if "heron_tflops" in p:
        lines += [f"Prefill attention, {p['tokens']} tokens causal: heron {p['heron']['gpu_ms']:.2f} ms "
                  f"({p['heron_tflops']:.1f} TFLOP/s), SDPA {p['sdpa_contiguous']['gpu_ms']:.2f} ms "
                  f"({p['sdpa_tflops']:.1f} TFLOP/s)", ""]
    if isinstance(p.get("cases"), dict):
        lines += _prefill_markdown(p)
    if isinstance(results.get("mamba"), dict) and "error" not in results["mamba"]:
        lines += _mamba_markdown(results["mamba"])
    sweep = results.get("decode_sweep")
    if isinstance(sweep, dict) and "shapes" in sweep:
        lines += _sweep_markdown(sweep)
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    for k, e in errors.items():
        lines += [f"**{k} failed**:", "```", e.strip()[-2000:], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name in wanted:
        t0 = time.perf_counter()
        try:
            if name in ("gemm", "decode", "mamba", "decode_sweep"):  # rooflines need the bandwidth
                bw = results.get("bandwidth", {}).get("copy_gbps") or section_bandwidth(args)["copy_gbps"]
                results[name] = globals()[f"section_{name}"](args, bw)
            else:
                results[name] = globals()[f"section_{name}"](args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.cuda.empty_cache()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s: "
              f"{json.dumps(results[name], default=str)[:2000]}", flush=True)
        # after every section: a run cut short by its time limit keeps what it measured
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
        report = markdown(results)
        (out / "gpu_bench.md").write_text(report)
    print(report)
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
