"""End-to-end GPU benchmark: a random Llama-3-8B-shaped model, heron vs transformers (sdpa).

Decode tokens/s at several batch sizes with 1k-token contexts (steps in which the whole
batch decodes), heron with async scheduling (the default on CUDA) and without, prefill
tokens/s on a 4k prompt, the HBM roofline of decode (weight + KV bytes per step / copy
bandwidth), and a profile of decode steps at one batch size. ``--from-bench`` runs the
attention kernels and GEMM setup a bench/gpu_bench.py run found fastest. Runs on CPU too
with ``--shape tiny`` (a smoke test of the code paths).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.random_model import LLAMA3_8B, RandomLlamaPlugin, write_config

TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 8192}


MAX_BATCHED_TOKENS = 8192


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes=4 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * nbytes / sorted(times)[len(times) // 2]


def heron_engine(model_dir: Path, device, dtype, max_seqs, kv_gb, cuda_graphs=True):
    from heron.core.config import load_config
    from heron.core.engine import Engine
    from heron.core.plugins import PluginManager

    plugins = PluginManager(load_entry_points=False)
    plugins.register(RandomLlamaPlugin(), name="random-llama")
    cfg = load_config(None, {
        "model.path": str(model_dir), "model.family": "random-llama",
        "model.dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
        "model.device": device.type, "engine.max_num_seqs": max_seqs,
        "engine.max_num_batched_tokens": MAX_BATCHED_TOKENS, "engine.kv_cache_memory_gb": kv_gb,
        "engine.cuda_graphs": cuda_graphs})
    return Engine(cfg, plugins)


@contextlib.contextmanager
def sync_steps(engine):
    """The same engine with each step's tokens read before the next step launches."""
    engine.async_scheduling, on = False, engine.async_scheduling
    try:
        yield
    finally:
        engine.async_scheduling = on


def start_batch(engine, name: str, batch: int, context: int, vocab: int, steps: int) -> list[str]:
    """Add ``batch`` greedy requests of ``context`` random tokens, each with room for ``steps``
    tokens past those it gets while the others prefill; step until each has its first token.
    Returns their ids."""
    from heron.core.sampling_params import SamplingParams

    stagger = batch * context // MAX_BATCHED_TOKENS + 2  # prefill steps: the first ones decode
    params = SamplingParams(max_tokens=steps + stagger + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [f"{name}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (context,), generator=g).tolist(), params)
    produced = {}
    while len(produced) < batch or min(produced.values()) < 1:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    sync(engine.device)
    return ids


def end_batch(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    sync(engine.device)
    assert engine.num_blocks_in_use == 0


def heron_decode(engine, batch: int, context: int, steps: int, vocab: int) -> dict:
    """Tokens/s over ``steps`` engine steps in which all ``batch`` sequences decode."""
    ids = start_batch(engine, f"d{batch}", batch, context, vocab, steps)
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        for out in engine.step():
            tokens += len(out.outputs[0].new_token_ids)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    end_batch(engine, ids)
    return {"batch": batch, "steps": steps, "tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed}


def profile_decode(engine, batch: int, context: int, steps: int, vocab: int,
                   tables: bool = True) -> dict:
    """Where a decode step's time goes: ``steps`` steps of ``batch`` sequences under the torch
    profiler. Prints the kernels by device time and the host's calls by CPU time (``tables``);
    returns wall and device ms per step."""
    from torch.profiler import ProfilerActivity, profile

    ids = start_batch(engine, f"p{batch}", batch, context, vocab, steps + 3)
    for _ in range(3):  # steady decode steps
        engine.step()
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = time.perf_counter() - start
    end_batch(engine, ids)
    events = prof.key_averages()
    if tables:  # the kernels, then where the host spends its time (waits show as CUDA calls)
        print(events.table(sort_by="self_device_time_total", row_limit=25), flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    device_us = sum(e.self_device_time_total for e in events)
    return {"batch": batch, "steps": steps, "async_scheduling": engine.async_scheduling,
            "wall_ms_per_step": wall * 1e3 / steps, "device_ms_per_step": device_us / 1e3 / steps}


def heron_prefill(engine, prompt_len: int, vocab: int, repeats: int = 3) -> dict:
    from heron.core.sampling_params import SamplingParams

    best = float("inf")
    for r in range(repeats + 1):
        ids = torch.randint(0, vocab, (prompt_len,)).tolist()
        sync(engine.device)
        start = time.perf_counter()
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        sync(engine.device)
        if r:  # the first run warms up
            best = min(best, time.perf_counter() - start)
    return {"prompt_tokens": prompt_len, "seconds": best, "tokens_per_s": prompt_len / best}


def hf_model(config: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


@torch.inference_mode()
def hf_decode(model, batch, context, steps, vocab, device) -> dict:
    ids = torch.randint(0, vocab, (batch, context), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    elapsed = time.perf_counter() - start
    return {"batch": batch, "tokens": batch * steps, "seconds": elapsed,
            "tokens_per_s": batch * steps / elapsed}


@torch.inference_mode()
def hf_prefill(model, prompt_len, vocab, device, repeats=3) -> dict:
    best = float("inf")
    for r in range(repeats + 1):
        ids = torch.randint(0, vocab, (1, prompt_len), device=device)
        sync(device)
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        sync(device)
        if r:
            best = min(best, time.perf_counter() - start)
    return {"prompt_tokens": prompt_len, "seconds": best, "tokens_per_s": prompt_len / best}


def roofline(config: dict, batch: int, context: int, bandwidth: float, dtype) -> float:
    """Decode tokens/s if every step only streamed the weights and the KV once."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d, q, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    size = torch.empty((), dtype=dtype).element_size()
    params = layers * (h * (q + 2 * kv) * d + q * d * h + 3 * h * i) + config["vocab_size"] * h
    kv_bytes = batch * context * layers * 2 * kv * d * size
    return batch / ((params * size + kv_bytes) / bandwidth)


#: Largest relative error vs SDPA a prefill kernel of the bench may have to be chosen.
PREFILL_ERR_LIMIT = 2e-2
#: gpu_bench's GEMM variants a run can switch to (a BLAS library of torch's, or the weights
#: laid out column-major), the batch whose decode-step GEMM time picks one, and by how much
#: it must beat the default ("linear") to be taken.
GEMM_CHOICES = {"linear-cublas": ("blas", "cublas"), "linear-cublaslt": ("blas", "cublaslt"),
                "transposed": ("weights", "column")}
GEMM_BATCH = 64
GEMM_MIN_GAIN = 0.02


def choose_kernels(bench: dict) -> dict:
    """Run the fastest correct attention kernels of a bench/gpu_bench.py run: its recommended
    decode variant with its fitted plan knobs, the fastest prefill kernel on the 4k prompt
    within PREFILL_ERR_LIMIT of SDPA; and the GEMM variant whose decode-step GEMMs at
    GEMM_BATCH rows were fastest, if it beats the default by GEMM_MIN_GAIN (a BLAS library
    is the process's, so transformers runs on it too). Returns what was chosen."""
    from heron.core.ops.cuda import attention, plan

    chosen = {}
    rec = bench.get("decode_sweep", {}).get("recommended") or {}
    if "config" in rec:
        plan.DECODE_CONFIG = plan.DecodeConfig(
            **rec["config"], ctas_per_sm=rec.get("ctas_per_sm", plan.DECODE_CTAS_PER_SM),
            max_partition=rec.get("max_partition", plan.MAX_PARTITION))
        chosen["decode"] = dataclasses.asdict(plan.DECODE_CONFIG)
    kernels = bench.get("prefill", {}).get("cases", {}).get("4096 causal", {}).get("kernels", {})
    ok = {label: r for label, r in kernels.items()
          if "gpu_ms" in r and not r["nan"] and r["rel_err_vs_sdpa"] <= PREFILL_ERR_LIMIT}
    if ok:
        label = min(ok, key=lambda lbl: ok[lbl]["gpu_ms"])
        kernel, _, tile = label.partition(" ")
        attention.PREFILL_KERNEL = kernel
        attention.PREFILL_MMA_TILE = plan.MmaTile(*map(int, tile.split("x"))) if tile else None
        chosen["prefill"] = label
    step = bench.get("gemm", {}).get("per_step_ms", {}).get(str(GEMM_BATCH), {})
    timed = {v: step[v] for v in GEMM_CHOICES if v in step}
    if timed and "linear" in step:
        variant = min(timed, key=timed.get)
        if timed[variant] < (1 - GEMM_MIN_GAIN) * step["linear"]:
            what, choice = GEMM_CHOICES[variant]
            if what == "blas":
                torch.backends.cuda.preferred_blas_library(choice)
            else:  # the module: the package's `linear` is the function
                importlib.import_module("heron.core.ops.linear").CUDA_WEIGHT_LAYOUT = choice
            chosen[what] = choice
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["llama3-8b", "tiny"], default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--kv-gb", type=float, default=40.0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-batch", type=int, default=64,
                        help="profile 8 decode steps at this batch size (0: none)")
    parser.add_argument("--from-bench", type=Path, default=None,
                        help="gpu_bench.json: run its fastest correct attention kernels "
                             "and GEMM setup")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LLAMA3_8B if args.shape == "llama3-8b" else TINY
    batches = [int(b) for b in args.batches.split(",")]
    kernels = choose_kernels(json.loads(args.from_bench.read_text())) \
        if args.from_bench and args.from_bench.exists() else {}
    print("kernels:", kernels or "defaults", flush=True)
    bandwidth = copy_bandwidth(device)
    results = {"kernels": kernels, "shape": args.shape, "device": str(device), "dtype": str(dtype),
               "context": args.context, "steps": args.steps, "copy_bandwidth_Bps": bandwidth,
               "heron": {"decode": [], "prefill": None}, "transformers": {"decode": [], "prefill": None}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", config)
        engine = heron_engine(model_dir, device, dtype, max(batches), args.kv_gb)
        for b in batches:
            r = heron_decode(engine, b, args.context, args.steps, config["vocab_size"])
            r["async_scheduling"] = engine.async_scheduling
            with sync_steps(engine):
                r["sync"] = heron_decode(engine, b, args.context, args.steps, config["vocab_size"])
            r["roofline_tokens_per_s"] = roofline(config, b, args.context + args.steps // 2,
                                                  bandwidth, dtype)
            results["heron"]["decode"].append(r)
            print("heron decode", r, flush=True)
        if args.profile_batch:
            profiles = [profile_decode(engine, args.profile_batch, args.context, 8,
                                       config["vocab_size"])]
            with sync_steps(engine):
                profiles.append(profile_decode(engine, args.profile_batch, args.context, 8,
                                               config["vocab_size"], tables=False))
            results["heron"]["profile"] = profiles
            print("heron decode profile", profiles, flush=True)
        results["heron"]["prefill"] = heron_prefill(engine, args.prefill, config["vocab_size"])
        print("heron prefill", results["heron"]["prefill"], flush=True)
        assert engine.num_blocks_in_use == 0
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_transformers:
        model = hf_model(config, device, dtype)
        for b in batches:
            r = hf_decode(model, b, args.context, args.steps, config["vocab_size"], device)
            results["transformers"]["decode"].append(r)
            print("transformers decode", r, flush=True)
        results["transformers"]["prefill"] = hf_prefill(model, args.prefill, config["vocab_size"],
                                                        device)
        print("transformers prefill", results["transformers"]["prefill"], flush=True)
    table = format_table(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_e2e.json").write_text(json.dumps(results, indent=2))
        (args.out / "gpu_e2e.md").write_text(table + "\n")


def format_table(results: dict) -> str:
    rows = ["| measure | heron | heron, sync steps | transformers | heron/transformers | "
            "heron/roofline |", "|---|---|---|---|---|---|"]
    hf = {r["batch"]: r for r in results["transformers"]["decode"]}
    for r in results["heron"]["decode"]:
        t = hf.get(r["batch"])
        rows.append(f"| decode tok/s, batch {r['batch']} | {r['tokens_per_s']:.0f} | "
                    f"{r['sync']['tokens_per_s']:.0f} | "
                    + (f"{t['tokens_per_s']:.0f} | {r['tokens_per_s'] / t['tokens_per_s']:.2f} | "
                       if t else "- | - | ")
                    + f"{r['tokens_per_s'] / r['roofline_tokens_per_s']:.2f} |")
    hp, tp = results["heron"]["prefill"], results["transformers"]["prefill"]
    if hp:
        rows.append(f"| prefill tok/s, {hp['prompt_tokens']} tokens | {hp['tokens_per_s']:.0f} | - | "
                    + (f"{tp['tokens_per_s']:.0f} | {hp['tokens_per_s'] / tp['tokens_per_s']:.2f} | - |"
                       if tp else "- | - | - |"))
    rows += ["", f"kernels: {results['kernels'] or 'defaults'}"]
    for prof in results["heron"].get("profile") or ():
        rows.append(f"decode step at batch {prof['batch']}"
                    f"{'' if prof['async_scheduling'] else ', sync steps'}: "
                    f"{prof['wall_ms_per_step']:.2f} ms wall, "
                    f"{prof['device_ms_per_step']:.2f} ms of kernels (profiled)")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
