"""Where a heron server's time goes under load: py-spy samples, sorted into categories.

Starts heron as `bench.compare` does, loads it with `bench.loadgen` (``--workload``, short
chats by default; streaming, ``ignore_eos``) at ``--concurrency``, samples every thread
with py-spy while the load runs (non-blocking; time inside torch's C++ kernels lands on the
Python line that called them) and sorts each sample by the innermost heron frame of its
stack:

- model math: the family's forward and ``core/ops`` (matmuls, attention, norms);
- sampling: ``core/sampler``, penalties, logprobs;
- scheduling and batching: the scheduler, block pool, prefix cache, batch building and the
  engine's own bookkeeping;
- detokenization and stops; HTTP and asyncio (the server's event loop, aiohttp, JSON);
- idle: threads waiting (for the engine's next step, for sockets).

Writes ``bench/results/profile-<date>.json`` and the raw stacks next to it (``.txt``, flame
graph input), and prints the table.

    python -m bench.profile_server --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from bench.compare import ROOT, free_port, heron, stop, wait_ready
from bench.loadgen import load_workload, run

# py-spy names frames "function (path:line)", paths relative to their sys.path entry. The
# first category with a marker in a frame, from the innermost frame outwards, is the sample's.
CATEGORIES = [
    ("model math: matmuls", ("(core/ops/linear.py", "(core/ops/quantized.py")),
    ("model math: attention", ("(core/ops/attention.py",)),
    ("model math: other ops and layer code", ("(plugins/", "(core/ops/")),
    ("sampling", ("(core/sampler.py", "(core/penalties.py", "(core/logprobs.py")),
    ("detokenization and stops", ("(core/detokenizer.py", "(core/stop.py",
                                  "(core/tokenizer.py", "(tokenizers/")),
    ("scheduling and batching", ("(core/scheduler.py", "(core/block_pool.py",
                                 "(core/prefix_cache.py", "(core/batch_builder.py",
                                 "(core/batch.py", "(core/sequence.py", "(core/engine.py",
                                 "(core/request.py", "(core/outputs.py")),
    ("HTTP and asyncio", ("(server/", "(aiohttp/", "(asyncio/", "(core/async_engine.py",
                          "(json/")),
]
IDLE_LEAVES = ("wait (threading.py", "select (selectors.py", "_worker (concurrent",
               "get (queue.py", "poll (selectors.py")


def categorize(stack: list[str]) -> str:
    """``stack``: frames root first, as py-spy's raw format lists them."""
    leaf = stack[-1] if stack else ""
    if any(marker in leaf for marker in IDLE_LEAVES):
        return "idle"
    for frame in reversed(stack):
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return "other"


def summarize(raw: str) -> dict:
    """Samples per category, overall and per thread, from py-spy's ``--format raw`` output."""
    totals, per_thread = Counter(), defaultdict(Counter)
    for line in raw.splitlines():
        frames, _, count = line.rpartition(" ")
        if not frames or not count.isdigit():
            continue
        stack = frames.split(";")
        thread = stack[0].partition(": ")[2] or stack[0]
        category = categorize(stack[1:])
        totals[category] += int(count)
        per_thread[thread][category] += int(count)
    busy = sum(v for k, v in totals.items() if k != "idle")
    return {"samples": sum(totals.values()), "busy_samples": busy,
            "share_of_busy": {k: v / busy for k, v in totals.most_common() if k != "idle"},
            "per_thread": {t: dict(c.most_common()) for t, c in per_thread.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--keep-quantized", choices=["false", "true", "int8"], default="false",
                        help="model.keep_quantized (bench.compare's heron, heron-q4_1, "
                             "heron-q4_1-int8)")
    parser.add_argument("--workload", default="short-chat")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rate", type=int, default=97, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()

    from heron.core.default_model import ensure_default_model

    port = free_port()
    kept = {"false": False, "true": True}.get(args.keep_quantized, args.keep_quantized)
    system = heron(ensure_default_model(), port, args.threads, args.concurrency,
                   keep_quantized=kept)
    url = f"http://127.0.0.1:{port}"
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    raw_path = args.out / f"profile-{date}.txt"
    proc = subprocess.Popen(system.command, env={**os.environ, **system.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_ready(url, proc, 300)
        asyncio.run(run(url, load_workload(args.workload, args.concurrency, 8),
                        concurrency=args.concurrency, ignore_eos=True, progress=False))
        spy = subprocess.Popen(
            [Path(sys.executable).parent / "py-spy", "record", "--pid", str(proc.pid),
             "--rate", str(args.rate), "--format", "raw", "--threads", "--nonblocking",
             "--output", str(raw_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        load = asyncio.run(run(url, load_workload(args.workload, args.requests, args.max_tokens),
                               concurrency=args.concurrency, ignore_eos=True))
        spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        spy.wait(60)
    finally:
        stop(proc)
    profile = summarize(raw_path.read_text())
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "workload": args.workload, "concurrency": args.concurrency,
              "threads": args.threads,
              "output_tokens_per_s": load["output_tokens_per_s"],
              "itl_ms": load["itl_ms"], **profile}
    (args.out / f"profile-{date}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{load['output_tokens_per_s']:.1f} output tokens/s at concurrency {args.concurrency}, "
          f"ITL p50 {load['itl_ms']['p50']:.1f} ms")
    print(f"{'share of busy samples':32}")
    for name, share in profile["share_of_busy"].items():
        print(f"  {name:30}{share:7.1%}")
    for thread, counts in profile["per_thread"].items():
        print(f"  thread {thread}: {counts}")
    print(f"raw stacks: {raw_path}")


if __name__ == "__main__":
    main()
