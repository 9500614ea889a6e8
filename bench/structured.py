"""Structured outputs: what a JSON schema costs heron and llama.cpp, in one run.

Both serve SmolLM2-135M-Instruct in fp32 (heron the Q4_1 GGUF dequantized at load,
llama.cpp's ``llama-server`` an F32 GGUF of the same weights) and get, through the same
client, two workloads at each concurrency:

- **throughput**: short chats with ``ignore_eos`` and a fixed ``--max-tokens``, free and
  under a schema that never completes within them (an array of at least 1000 strings), so
  both modes produce the same number of tokens; the ratio guided / free is what the grammar
  costs each system;
- **validity**: chats asking for a person as JSON under ``response_format`` with a small
  schema, greedy, up to 256 tokens: how many answers `jsonschema` accepts, and requests/s.

Writes ``bench/results/structured-<date>.json`` and a markdown table (``.md``).

    python -m bench.structured [--systems heron,llama.cpp-f32] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
from pathlib import Path

import jsonschema

from bench.compare import ROOT, free_port, heron, llama_cpp, served
from bench.loadgen import Request, load_workload, run
from bench.machine import describe

NEVER_DONE = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}}}


def json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}


def people(n: int) -> list[Request]:
    return [Request(256, messages=[{"role": "user", "content": f"Invent person number {i} "
                                    "with a name, an age and a city, as JSON."}])
            for i in range(n)]


def measure(system, port: int, args) -> dict:
    log_dir = args.out / f"structured-{dt.date.today().isoformat()}-logs"
    log_dir.mkdir(exist_ok=True)
    out = {"version": system.version, "throughput": {}, "validity": {}}
    with served(system, port, log_dir, args.startup_timeout) as url:
        top = max(args.concurrency)
        for extra in ({}, json_schema(NEVER_DONE)):  # warm-up, first-call costs
            asyncio.run(run(url, load_workload("short-chat", top, 8), concurrency=top,
                            ignore_eos=True, extra_body=extra, progress=False))
        for c in args.concurrency:
            n = max(args.requests_per_client * c, 4)
            row = {}
            for mode, extra in (("free", {}), ("guided", json_schema(NEVER_DONE))):
                r = asyncio.run(run(url, load_workload("short-chat", n, args.max_tokens),
                                    concurrency=c, ignore_eos=True, extra_body=extra,
                                    progress=False))
                row[mode] = {k: r[k] for k in ("output_tokens_per_s", "errors", "itl_ms")}
            row["guided_over_free"] = (row["guided"]["output_tokens_per_s"]
                                       / row["free"]["output_tokens_per_s"])
            out["throughput"][str(c)] = row
            print(f"  {system.name} c={c}: free {row['free']['output_tokens_per_s']:.1f} "
                  f"tok/s, guided {row['guided']['output_tokens_per_s']:.1f} tok/s "
                  f"({row['guided_over_free']:.2f})", flush=True)
            texts: list[str] = []
            r = asyncio.run(run(url, people(n), concurrency=c, extra_body=json_schema(PERSON),
                                progress=False, on_text=texts.append))
            valid = sum(_valid(t) for t in texts)
            out["validity"][str(c)] = {"requests": n, "valid": valid, "errors": r["errors"],
                                       "requests_per_s": r["requests_per_s"],
                                       "output_tokens": r["output_tokens"]}
            print(f"  {system.name} c={c}: {valid}/{n} answers valid, "
                  f"{r['requests_per_s']:.2f} req/s", flush=True)
    return out


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def markdown(results: dict) -> str:
    lines = [f"# Structured outputs, {results['date']}", "",
             f"Machine: {results['machine']}", "",
             "| system | concurrency | free tok/s | guided tok/s | guided / free | "
             "valid JSON | req/s (validity) |", "|---|---|---|---|---|---|---|"]
    for name, s in results["systems"].items():
        if "missing" in s or "failed" in s:
            lines.append(f"| {name} | {s.get('missing') or s.get('failed')} |||||")
            continue
        for c, row in s["throughput"].items():
            v = s["validity"][c]
            lines.append(f"| {name} | {c} | {row['free']['output_tokens_per_s']:.1f} | "
                         f"{row['guided']['output_tokens_per_s']:.1f} | "
                         f"{row['guided_over_free']:.2f} | {v['valid']}/{v['requests']} | "
                         f"{v['requests_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="heron,llama.cpp-f32")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    max_seqs = max(args.concurrency)

    from bench.peers.models import f32_gguf
    from heron.core.default_model import ensure_default_model

    gguf = ensure_default_model()
    makers = {
        "heron": lambda port: heron(gguf, port, args.threads, max_seqs),
        "llama.cpp-f32": lambda port: llama_cpp(f32_gguf(gguf), "F32", port, args.threads,
                                                max_seqs),
    }
    results = {"date": dt.datetime.now().isoformat(timespec="seconds"),
               "machine": {**describe(), "threads": args.threads},
               "workload": {"max_tokens": args.max_tokens, "model": gguf.name,
                            "throughput_schema": NEVER_DONE, "validity_schema": PERSON},
               "systems": {}}
    for name in args.systems.split(","):
        port = free_port()
        system = makers[name](port)
        if system.missing:
            print(f"{name}: skipped, {system.missing}")
            results["systems"][name] = {"missing": system.missing}
            continue
        print(f"{name}: {system.version}", flush=True)
        try:
            results["systems"][name] = measure(system, port, args)
        except Exception as e:  # one system failing must not lose the other's results
            results["systems"][name] = {"failed": f"{type(e).__name__}: {e}"}
            print(f"{name}: failed, {e}")
    stem = args.out / f"structured-{dt.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    stem.with_suffix(".md").write_text(table)
    print(table)
    print(f"written to {stem}.json, .md")


if __name__ == "__main__":
    main()
