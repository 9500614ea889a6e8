"""Priority scheduling: how long urgent requests wait behind a saturating batch load.

heron serves SmolLM2-135M-Instruct (fp32) twice, with ``engine.scheduling_policy`` "fcfs"
and "priority", and gets the same two loads at once through one client:

- **batch**: more conversations open than the engine runs at once (``--batch-concurrency``
  against ``--max-seqs``), long answers (EOS ignored), ``priority: 1`` under "priority";
- **urgent**: short chats arriving as a Poisson stream, ``priority: -1`` under "priority".

Reported per policy: the urgent requests' TTFT and TPOT, and the batch load's output
tokens/s; and the ratios of "priority" to "fcfs". Writes
``bench/results/priority-<date>.json`` and a markdown table (``.md``).

    python -m bench.priority [--batch-concurrency 24] [--max-seqs 8] [--urgent 16]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
from pathlib import Path

from bench.compare import ROOT, free_port, heron, served
from bench.loadgen import load_workload, run
from bench.machine import describe


async def loads(url: str, policy: str, args) -> tuple[dict, dict]:
    ranked = policy == "priority"
    batch = run(url, load_workload("short-chat", args.batch_requests, args.batch_tokens),
                concurrency=args.batch_concurrency, ignore_eos=True, progress=False,
                extra_body={"priority": 1} if ranked else None)

    async def urgent() -> dict:
        await asyncio.sleep(args.head_start)  # the batch load fills the engine first
        return await run(url, load_workload("short-chat", args.urgent, args.urgent_tokens),
                         request_rate=args.urgent_rate, ignore_eos=True, progress=False,
                         seed=1, extra_body={"priority": -1} if ranked else None)

    return tuple(await asyncio.gather(batch, urgent()))


def measure(gguf: Path, policy: str, args, log_dir: Path) -> dict:
    port = free_port()
    system = heron(gguf, port, args.threads, args.max_seqs)
    system = dataclasses.replace(system, name=policy, command=system.command + [
        "--set", f"engine.scheduling_policy={policy}"])
    with served(system, port, log_dir, args.startup_timeout) as url:
        asyncio.run(run(url, load_workload("short-chat", 8, 8), concurrency=8,
                        progress=False))  # warm-up
        batch, urgent = asyncio.run(loads(url, policy, args))
    row = {"urgent": {k: urgent[k] for k in ("completed", "errors", "ttft_ms", "tpot_ms")},
           "batch": {k: batch[k] for k in ("completed", "errors", "output_tokens_per_s")}}
    print(f"  {policy}: urgent TTFT p50 {urgent['ttft_ms']['p50']:.0f} ms, "
          f"p90 {urgent['ttft_ms']['p90']:.0f} ms; batch "
          f"{batch['output_tokens_per_s']:.1f} tok/s", flush=True)
    return row


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [f"# Priority scheduling, {results['date']}", "", f"Machine: {results['machine']}",
             "", f"SmolLM2-135M fp32; engine.max_num_seqs {s['max_seqs']}; batch load: "
             f"{s['batch_requests']} chats, {s['batch_concurrency']} open, "
             f"{s['batch_tokens']} tokens each; urgent: {s['urgent']} chats of "
             f"{s['urgent_tokens']} tokens at {s['urgent_rate']}/s.", "",
             "| policy | urgent TTFT p50 ms | p90 ms | urgent TPOT p50 ms | batch tok/s |",
             "|---|---|---|---|---|"]
    for policy, row in results["policies"].items():
        u = row["urgent"]
        lines.append(f"| {policy} | {u['ttft_ms']['p50']:.0f} | {u['ttft_ms']['p90']:.0f} | "
                     f"{u['tpot_ms']['p50']:.1f} | {row['batch']['output_tokens_per_s']:.1f} |")
    r = results["ratios"]
    lines += ["", f"priority / fcfs: urgent TTFT p50 {r['urgent_ttft_p50']:.3f}, p90 "
              f"{r['urgent_ttft_p90']:.3f}; batch tokens/s {r['batch_tokens_per_s']:.3f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seqs", type=int, default=8)
    parser.add_argument("--batch-concurrency", type=int, default=24)
    parser.add_argument("--batch-requests", type=int, default=48)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--urgent", type=int, default=16)
    parser.add_argument("--urgent-tokens", type=int, default=16)
    parser.add_argument("--urgent-rate", type=float, default=0.5)
    parser.add_argument("--head-start", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from heron.core.default_model import ensure_default_model

    gguf = ensure_default_model()
    date = dt.date.today().isoformat()
    log_dir = args.out / f"priority-{date}-logs"
    log_dir.mkdir(exist_ok=True)
    policies = {policy: measure(gguf, policy, args, log_dir) for policy in ("fcfs", "priority")}
    fcfs, ranked = policies["fcfs"], policies["priority"]
    results = {
        "date": date, "machine": describe(),
        "settings": {k: getattr(args, k) for k in (
            "max_seqs", "batch_concurrency", "batch_requests", "batch_tokens", "urgent",
            "urgent_tokens", "urgent_rate", "head_start", "threads")},
        "policies": policies,
        "ratios": {
            **{f"urgent_ttft_{q}": (ranked["urgent"]["ttft_ms"][q]
                                    / fcfs["urgent"]["ttft_ms"][q]) for q in ("p50", "p90")},
            "batch_tokens_per_s": (ranked["batch"]["output_tokens_per_s"]
                                   / fcfs["batch"]["output_tokens_per_s"])}}
    path = args.out / f"priority-{date}.json"
    path.write_text(json.dumps(results, indent=1))
    path.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
