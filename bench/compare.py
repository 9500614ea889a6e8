"""heron against its peers, one after another in one run: same client, workload and threads.

Each system serves SmolLM2-135M-Instruct on this machine and gets the same load from
`bench.loadgen` (short chats, streaming, greedy, ``ignore_eos`` so every request produces
exactly ``--max-tokens`` tokens) at each concurrency, then is stopped before the next starts.
Systems (a peer that is not set up is skipped, saying why; ``bench/peers/setup_*.sh``):

- heron, fp32 (``--dtype``), the Q4_1 GGUF dequantized at load (``keep_quantized = false``);
  ``heron-q4_1``: its weights kept quantized (the default), float32 activations;
  ``heron-q4_1-int8``: and decode batches' activations rounded to int8
  (``keep_quantized = "int8"``); ``heron-q4_k_m`` and ``heron-q4_k_m-int8``: the same on the
  GGUF requantized to Q4_K_M by llama.cpp's quantizer (`bench.peers.models.requantized_gguf`);
- vLLM's CPU build, fp32 (``--dtype``), an HF directory of the same dequantized weights, tuned
  as its CPU docs advise (tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to the
  cores);
- llama.cpp's ``llama-server`` on the Q4_1 GGUF, on an F32 GGUF of the same weights and
  (``llama.cpp-q4_k_m``) on the Q4_K_M one;
- ``transformers serve`` (continuous batching), fp32 (``--dtype``), on the HF directory; it
  has no ``ignore_eos``, so it serves a copy whose generation config has no EOS.

Every system runs its model math on ``--threads`` threads (default: all cores). The whole
sequence runs ``--rounds`` times (default 2) and each system's best round counts: a noisy
machine slows runs down at random, and a round per system spreads that over all of them. Writes
``bench/results/compare-<date>.json``, a markdown table (``.md``) with ratios to heron, and a
plot (``.png``) of throughput and TTFT against concurrency.

    python -m bench.compare [--systems heron,heron-q4_1,vllm,llama.cpp-q4_1,llama.cpp-f32,transformers]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import load_workload, run
from bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("HERON_PEERS", Path.home() / ".cache/heron/peers"))


@dataclass
class System:
    name: str
    precision: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""
    missing: str = ""  # why it cannot run here; empty when it can
    ignore_eos: bool = True  # False: the server has no such field; its model never stops


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# KV cache memory each server gets (GiB), so that none holds fewer sequences than another
KV_CACHE_GB = 4
# Longest context a peer is told to serve (llama.cpp splits its context among its slots)
MAX_MODEL_LEN = 2048
# The precision each ``--dtype`` is reported as
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def heron(model: Path, port: int, threads: int, max_seqs: int, dtype: str = "float32",
          keep_quantized: bool | str = False, file_type: str = "Q4_1") -> System:
    """heron serving ``model``; kept quantized, named for the file's type (heron-q4_1)."""
    from importlib.metadata import version

    name, precision = "heron", PRECISION[dtype]
    if keep_quantized:
        name, precision = f"heron-{file_type.lower()}", file_type
    if keep_quantized == "int8":
        name, precision = name + "-int8", precision + " x int8"
    setting = keep_quantized if isinstance(keep_quantized, str) else str(keep_quantized).lower()
    return System(
        name, precision,
        [sys.executable, "-m", "heron.server.cli", "serve", str(model), "--port", str(port),
         "--set", f"model.dtype={dtype}", "--set", f"model.num_threads={threads}",
         "--set", f"model.keep_quantized={setting}",
         "--set", f"engine.max_num_seqs={max_seqs}",
         "--set", f"engine.kv_cache_memory_gb={KV_CACHE_GB}", "--set", "logging.level=warning",
         "--set", "logging.log_requests=false"],
        {"OMP_NUM_THREADS": str(threads)}, version=f"heron {version('heron')}")


def vllm(hf_dir: Path, port: int, threads: int, max_seqs: int,
         dtype: str = "float32") -> System:
    python = PEERS / "vllm/bin/python"
    if not python.exists():
        return System("vllm", PRECISION[dtype], [], missing="run bench/peers/setup_vllm.sh")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    preload = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                           PEERS / "vllm/lib/libiomp5.so") if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True)
    return System(
        "vllm", PRECISION[dtype],
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
         "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_seqs),
         "--max-model-len", str(MAX_MODEL_LEN)],
        env, version=f"vllm-cpu {out.stdout.strip()}",
        missing="" if out.returncode == 0 else f"vllm does not import: {out.stderr[-300:]}")


def llama_cpp(gguf: Path, precision: str, port: int, threads: int, max_seqs: int) -> System:
    server = PEERS / "llama.cpp/bin/llama-server"
    name = f"llama.cpp-{precision.lower()}"
    if not server.exists():
        return System(name, precision, [], missing="run bench/peers/setup_llamacpp.sh")
    out = subprocess.run([server, "--version"], capture_output=True, text=True)
    version = (out.stdout + out.stderr).strip().splitlines()
    return System(
        name, precision,
        [str(server), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb",
         str(threads), "--parallel", str(max_seqs), "--cont-batching",
         "--ctx-size", str(MAX_MODEL_LEN * max_seqs), "--no-webui"],
        {"LD_LIBRARY_PATH": str(server.parent)},
        version=f"llama.cpp {version[0] if version else '?'} "
                f"(llama-cpp-python {(PEERS / 'llama.cpp/VERSION').read_text().strip()})")


def transformers_serve(hf_dir: Path, port: int, threads: int,
                       dtype: str = "float32") -> System:
    cli = PEERS / "transformers/bin/transformers"
    if not cli.exists():
        return System("transformers", PRECISION[dtype], [],
                      missing="run bench/peers/setup_transformers.sh")
    out = subprocess.run([cli.parent / "python", "-c",
                          "import transformers; print(transformers.__version__)"],
                         capture_output=True, text=True)
    return System(
        "transformers", PRECISION[dtype],
        [str(cli), "serve", str(hf_dir), "--continuous-batching", "--dtype", dtype,
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
        {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"},
        version=f"transformers {out.stdout.strip()} (serve)", ignore_eos=False)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def served(system: System, port: int, log_dir: Path, startup_timeout: float):
    """``system`` serving on ``port`` for the block (its output appended to
    ``log_dir/<name>.log``); yields its URL once it answers, stops it at the end."""
    url = f"http://127.0.0.1:{port}"
    with (log_dir / f"{system.name}.log").open("a") as log:
        proc = subprocess.Popen(system.command, env={**os.environ, **system.env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(url, proc, startup_timeout)
            yield url
        finally:
            stop(proc)


def bench_system(system: System, port: int, args, log_dir: Path) -> tuple[float, dict]:
    """``(start-up seconds, the load generator's summary per concurrency)``."""
    runs = {}
    start = time.perf_counter()
    with served(system, port, log_dir, args.startup_timeout) as url:
        startup_s = time.perf_counter() - start
        # Warm-up at the highest concurrency: first-call costs, compiled graphs, allocators.
        top = max(args.concurrency)
        asyncio.run(run(url, load_workload("short-chat", top, 8), concurrency=top,
                        ignore_eos=system.ignore_eos, progress=False))
        for c in args.concurrency:
            workload = load_workload(args.workload, max(args.requests_per_client * c, 4),
                                     args.max_tokens)
            print(f"  {system.name} concurrency {c}: {len(workload)} requests", flush=True)
            runs[str(c)] = asyncio.run(run(url, workload, concurrency=c,
                                           ignore_eos=system.ignore_eos))
            r = runs[str(c)]
            print(f"    {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms, "
                  f"errors {r['errors']}", flush=True)
    return startup_s, runs


def ratio(a, b) -> float | None:
    return a / b if a and b else None


def markdown(results: dict) -> str:
    systems = results["systems"]
    heron = systems.get("heron", {}).get("runs", {})
    lines = [f"SmolLM2-135M-Instruct, {results['workload']['name']}, "
             f"{results['workload']['max_tokens']} output tokens per request (ignore_eos), "
             f"{results['machine']['threads']} threads per system, best of "
             f"{results['workload']['rounds']} rounds, {results['date']}.", "",
             "| system | precision | concurrency | output tok/s | each round | heron ÷ system | "
             "TTFT p50 ms | ITL p50 ms | TPOT p50 ms | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in systems.items():
        if not s.get("runs"):
            lines.append(f"| {name} | {s['precision']} | – | – | – | – | – | – | – | "
                         f"{s.get('missing') or s.get('failed')} |")
            continue
        for c, r in s["runs"].items():
            h = heron.get(c, {}).get("output_tokens_per_s")
            rat = ratio(h, r["output_tokens_per_s"])
            each = " / ".join(f"{x[c]['output_tokens_per_s']:.0f}" for x in s["rounds"])
            errors = sum(sum(x[c]["errors"].values()) for x in s["rounds"])
            lines.append(
                f"| {name} | {s['precision']} | {c} | {r['output_tokens_per_s']:.1f} | {each} | "
                f"{f'{rat:.2f}' if rat else '–'} | {r['ttft_ms']['p50']:.0f} | "
                f"{r['itl_ms']['p50']:.1f} | {r['tpot_ms']['p50']:.1f} | {errors} |")
    lines += ["", "Versions and commands:", ""]
    lines += [f"- {name}: {s['version']}; `{s['command']}`; env {s['env']}"
              for name, s in systems.items() if not s.get("missing")]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Throughput and TTFT against concurrency, to ``path``; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, s in results["systems"].items():
        runs = s.get("runs")
        if not runs:
            continue
        cs = [int(c) for c in runs]
        tput.plot(cs, [r["output_tokens_per_s"] for r in runs.values()], "o-", label=name)
        ttft.plot(cs, [r["ttft_ms"]["p50"] for r in runs.values()], "o-", label=name)
    for ax, title in ((tput, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ttft.set_yscale("log")
    tput.legend()
    fig.suptitle(f"SmolLM2-135M on {results['machine']['cpus']} CPU cores, "
                 f"{results['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems",
                        default="heron,vllm,llama.cpp-q4_1,llama.cpp-f32,transformers")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--workload", default="short-chat")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(PRECISION), default="float32",
                        help="of heron, vLLM and transformers (llama.cpp runs its GGUFs' own)")
    parser.add_argument("--requests-per-client", type=int, default=3,
                        help="requests per concurrency level = this x concurrency (at least 4)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=2,
                        help="run every system this many times, in turn; report each one's best")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    max_seqs = max(args.concurrency)

    from bench.peers.models import f32_gguf, hf_dir, hf_dir_without_eos, requantized_gguf
    from heron.core.default_model import ensure_default_model

    gguf = ensure_default_model()

    def on_q4_k_m(name: str, make) -> System:
        """``make`` on the default model requantized to Q4_K_M by llama.cpp's library."""
        libllama = PEERS / "llama.cpp/bin/libllama.so"
        if not libllama.exists():
            return System(name, "Q4_K_M", [], missing="run bench/peers/setup_llamacpp.sh "
                                                      "(its library makes the Q4_K_M file)")
        return make(requantized_gguf(gguf, "Q4_K_M", libllama))

    makers = {
        "heron": lambda port: heron(gguf, port, args.threads, max_seqs, args.dtype),
        "heron-q4_1": lambda port: heron(gguf, port, args.threads, max_seqs,
                                         keep_quantized=True),
        "heron-q4_1-int8": lambda port: heron(gguf, port, args.threads, max_seqs,
                                              keep_quantized="int8"),
        "vllm": lambda port: vllm(hf_dir(gguf), port, args.threads, max_seqs, args.dtype),
        "heron-q4_k_m": lambda port: on_q4_k_m("heron-q4_k_m", lambda path: heron(
            path, port, args.threads, max_seqs, keep_quantized=True, file_type="Q4_K_M")),
        "heron-q4_k_m-int8": lambda port: on_q4_k_m("heron-q4_k_m-int8", lambda path: heron(
            path, port, args.threads, max_seqs, keep_quantized="int8", file_type="Q4_K_M")),
        "llama.cpp-q4_1": lambda port: llama_cpp(gguf, "Q4_1", port, args.threads, max_seqs),
        "llama.cpp-q4_k_m": lambda port: on_q4_k_m("llama.cpp-q4_k_m", lambda path: llama_cpp(
            path, "Q4_K_M", port, args.threads, max_seqs)),
        "llama.cpp-f32": lambda port: llama_cpp(f32_gguf(gguf), "F32", port, args.threads,
                                                max_seqs),
        "transformers": lambda port: transformers_serve(hf_dir_without_eos(gguf), port,
                                                        args.threads, args.dtype),
    }
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / f"compare-{date}-logs"
    log_dir.mkdir(exist_ok=True)
    results = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {**describe(), "threads": args.threads},
        "workload": {"name": args.workload, "max_tokens": args.max_tokens,
                     "requests_per_client": args.requests_per_client, "greedy": True,
                     "rounds": args.rounds,
                     "ignore_eos": True, "streaming": True, "model": gguf.name},
        "systems": {},
    }
    names = args.systems.split(",")
    for round_ in range(args.rounds):
        for name in names:
            entry = results["systems"].get(name)
            if entry is not None and (entry.get("missing") or entry.get("failed")):
                continue
            port = free_port()
            system = makers[name](port)
            if entry is None:
                entry = results["systems"][name] = {
                    "precision": system.precision, "version": system.version,
                    "command": " ".join(system.command), "env": system.env, "rounds": []}
            if system.missing:
                print(f"{name}: skipped, {system.missing}")
                entry["missing"] = system.missing
                continue
            print(f"{name} (round {round_ + 1}/{args.rounds}): {system.version}", flush=True)
            try:
                entry["startup_s"], runs = bench_system(system, port, args, log_dir)
                entry["rounds"].append(runs)
            except Exception as e:  # one peer failing must not lose the others' results
                entry["failed"] = f"{type(e).__name__}: {e} (log: {log_dir / name}.log)"
                print(f"{name}: failed, {entry['failed']}")
    for entry in results["systems"].values():
        if entry.get("rounds"):  # a round that failed is left out, and named in "failed"
            # Best round per concurrency: the machine's noise only ever slows a run down.
            entry["runs"] = {c: max((r[c] for r in entry["rounds"]),
                                    key=lambda r: r["output_tokens_per_s"])
                             for c in entry["rounds"][0]}
    stem = args.out / f"compare-{date}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    stem.with_suffix(".md").write_text(table)
    plotted = plot(results, stem.with_suffix(".png"))
    print(table)
    print(f"written to {stem}.json, .md" + (", .png" if plotted else
                                           " (no plot: matplotlib, in the bench extra, is missing)"))


if __name__ == "__main__":
    main()
