"""GPU microbenchmarks for one device session: bandwidth, matmul, heron's kernels vs torch.

Sections (``--only a,b``; default all): ``env``, ``bandwidth`` (device-to-device copy,
GB/s), ``matmul`` (bf16 8192^3, TFLOP/s), ``ops`` (norm / activation / rotary / KV write
vs their torch references), ``decode`` (paged decode attention at batch 1/16/64/256, 1k
context, Llama-3-8B shapes, vs torch SDPA on contiguous K/V and vs the HBM roofline),
``prefill`` (a 4k prompt vs SDPA causal). A section that fails is recorded with its error
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
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

GRAPH_CALLS = 20
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, hidden=4096,
             intermediate=14336)


# ---------------------------------------------------------------------------- timing


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
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = time_eager(lambda: b.copy_(a), reps=20)
    return {"copy_bytes": nbytes, "copy_ms": ms, "copy_gbps": 2 * nbytes / ms / 1e6}


def section_matmul(args) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_eager(lambda: a @ b, reps=20)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}


def section_ops(args) -> dict:
    from heron.core import ops
    from heron.core.ops import cuda as cuda_ops

    h, inter = LLAMA["hidden"], LLAMA["intermediate"]
    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    cs = ops.rope_cos_sin_cache(d, 8192, 500000.0).cuda()
    results = {}
    for t in (1, 64, 4096):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        cache = torch.zeros(2, t // 16 + 2, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(cache.shape[1] * 16, device="cuda")[:t]
        pairs = {
            "rms_norm+residual": (lambda: cuda_ops.rms_norm(x, w, 1e-5, x),
                                  lambda: ops.rms_norm_ref(x, w, 1e-5, x)),
            "silu_and_mul": (lambda: cuda_ops.silu_and_mul(gu), lambda: ops.silu_and_mul_ref(gu)),
            "rotary": (lambda: cuda_ops.rotary(q, k, pos, cs), lambda: ops.rotary_ref(q, k, pos, cs)),
            "write_kv": (lambda: cuda_ops.write_kv(k, v, cache[0], cache[1], slots),
                         lambda: ops.write_kv_ref(k, v, cache[0], cache[1], slots)),
        }
        for name, (heron_fn, ref_fn) in pairs.items():
            results[f"{name} T={t}"] = {"heron": time_kernel(heron_fn), "torch": time_kernel(ref_fn)}
    return results


def _paged_kv(num_seqs: int, context: int, dtype=torch.bfloat16):
    """A shuffled paged cache holding ``num_seqs`` contexts, and its metadata for decode."""
    from heron.core.batch import AttentionMetadata

    bs, hkv, d = LLAMA["block_size"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    per_seq = -(-context // bs)
    num_blocks = num_seqs * per_seq + 1
    kv = torch.randn(2, num_blocks, bs, hkv, d, device="cuda", dtype=dtype)
    tables = (1 + torch.randperm(num_blocks - 1, device="cuda")).view(num_seqs, per_seq).int()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=seq_lens, block_tables=tables, query_lens_list=[1] * num_seqs,
        seq_lens_list=[context] * num_seqs, max_query_len=1, max_seq_len=context, block_size=bs)
    return kv, meta


def section_decode(args, bandwidth_gbps: float | None) -> dict:
    from heron.core.ops import cuda as cuda_ops

    hq, hkv, d = LLAMA["num_q_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"]
    context, scale = 1024, d ** -0.5
    results = {}
    for batch in (1, 16, 64, 256):
        kv, meta = _paged_kv(batch, context)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        heron = time_kernel(lambda: cuda_ops.paged_attention(q, kv[0], kv[1], meta, scale))
        # torch reference: SDPA over the same K/V gathered into contiguous [B, Hkv, L, D].
        k = kv[0][meta.block_tables.long()].view(batch, -1, hkv, d)[:, :context].transpose(1, 2).contiguous()
        v = kv[1][meta.block_tables.long()].view(batch, -1, hkv, d)[:, :context].transpose(1, 2).contiguous()
        q4 = q.unsqueeze(2)
        sdpa = time_kernel(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
        kv_bytes = 2 * batch * context * hkv * d * 2
        row = {"heron": heron, "sdpa_contiguous": sdpa, "kv_bytes": kv_bytes,
               "heron_gbps": kv_bytes / heron["gpu_ms"] / 1e6}
        if bandwidth_gbps:
            roofline_ms = kv_bytes / bandwidth_gbps / 1e6
            row["roofline_ms"] = roofline_ms
            row["x_roofline"] = heron["gpu_ms"] / roofline_ms
        results[f"batch {batch}"] = row
        del kv, k, v
    return results


def section_prefill(args) -> dict:
    from heron.core.batch import AttentionMetadata
    from heron.core.ops import cuda as cuda_ops

    hq, hkv, d, bs = (LLAMA[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"))
    length, scale = 4096, d ** -0.5
    num_blocks = length // bs + 1
    kv = torch.randn(2, num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    tables = (1 + torch.randperm(num_blocks - 1, device="cuda")).view(1, -1).int()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(length, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([length], dtype=torch.int32, device="cuda"), block_tables=tables,
        query_lens_list=[length], seq_lens_list=[length], max_query_len=length,
        max_seq_len=length, block_size=bs)
    q = torch.randn(length, hq, d, device="cuda", dtype=torch.bfloat16)
    heron = {"eager_ms": time_eager(lambda: cuda_ops.paged_attention(q, kv[0], kv[1], meta, scale), reps=10)}
    k = kv[0][tables.long()].view(1, -1, hkv, d).transpose(1, 2).contiguous()
    v = kv[1][tables.long()].view(1, -1, hkv, d).transpose(1, 2).contiguous()
    q4 = q.transpose(0, 1).unsqueeze(0)
    sdpa = {"eager_ms": time_eager(lambda: F.scaled_dot_product_attention(
        q4, k, v, is_causal=True, scale=scale, enable_gqa=True), reps=10)}
    flops = 4 * hq * d * length * (length + 1) / 2  # QK^T and PV over the causal half
    return {"tokens": length, "heron": heron, "sdpa_contiguous": sdpa,
            "heron_tflops": flops / heron["eager_ms"] / 1e9,
            "sdpa_tflops": flops / sdpa["eager_ms"] / 1e9}


SECTIONS = ["env", "bandwidth", "matmul", "ops", "decode", "prefill"]


# ---------------------------------------------------------------------------- report


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
        lines += ["| op | heron µs (gpu / eager) | torch µs (gpu / eager) |", "|---|---|---|"]
        for name, r in results["ops"].items():
            h, t = r["heron"], r["torch"]
            lines.append(f"| {name} | {h['gpu_ms']*1e3:.1f} / {h['eager_ms']*1e3:.1f} | "
                         f"{t['gpu_ms']*1e3:.1f} / {t['eager_ms']*1e3:.1f} |")
        lines.append("")
    if isinstance(results.get("decode"), dict) and "error" not in results["decode"]:
        lines += ["Decode attention, 1k context, Llama-3-8B shapes (32q/8kv heads, d128, bf16, block 16)", "",
                  "| batch | heron µs | heron eager µs | KV GB/s | x roofline | SDPA contiguous µs |",
                  "|---|---|---|---|---|---|"]
        for name, r in results["decode"].items():
            lines.append(f"| {name[6:]} | {r['heron']['gpu_ms']*1e3:.1f} | {r['heron']['eager_ms']*1e3:.1f} | "
                         f"{r['heron_gbps']:.0f} | {r.get('x_roofline', float('nan')):.2f} | "
                         f"{r['sdpa_contiguous']['gpu_ms']*1e3:.1f} |")
        lines.append("")
    p = results.get("prefill", {})
    if "heron_tflops" in p:
        lines += [f"Prefill attention, {p['tokens']} tokens causal: heron {p['heron']['eager_ms']:.2f} ms "
                  f"({p['heron_tflops']:.1f} TFLOP/s), SDPA {p['sdpa_contiguous']['eager_ms']:.2f} ms "
                  f"({p['sdpa_tflops']:.1f} TFLOP/s)", ""]
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
            if name == "decode":  # the roofline needs the measured bandwidth
                bw = results.get("bandwidth", {}).get("copy_gbps") or section_bandwidth(args)["copy_gbps"]
                results[name] = section_decode(args, bw)
            else:
                results[name] = globals()[f"section_{name}"](args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.cuda.empty_cache()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s: "
              f"{json.dumps(results[name], default=str)[:2000]}", flush=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
    report = markdown(results)
    (out / "gpu_bench.md").write_text(report)
    print(report)
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
