"""Embedding throughput: heron against vLLM's pooling runner on SmolLM2, one after another.

Both serve SmolLM2-135M-Instruct as an embedding model (last-token pooling, L2-normalized,
fp32, ``--threads`` threads): heron with ``model.task = "embed"`` on the GGUF (dequantized
at load), vLLM with ``--runner pooling --convert embed`` on the HF directory of the same
weights (`bench.peers.models`). The same client sends both the same texts (sentences of a
policy document, 10-200 tokens, each opening with a word of its round and shape, so that
no round reuses another's prefix cache) in each shape: ``--inputs`` texts in calls of ``batch``
inputs, ``concurrency`` calls at a time. Each system runs every shape ``--rounds`` times and
its best round counts. Reports inputs/s and prompt tokens/s, heron ÷ vLLM, and how closely
the two systems' vectors agree (the least cosine similarity over the texts). Writes
``bench/results/embeddings-<date>.json`` and a markdown table (``.md``).

    python -m bench.embeddings [--systems heron,vllm] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.compare import ROOT, free_port, heron, served, vllm
from bench.machine import describe
from bench.workloads import system_prompt

SHAPES = ((1, 8), (32, 2))  # (inputs per call, calls at a time)


def texts(n: int) -> list[str]:
    """``n`` deterministic texts of 1 to 12 policy sentences."""
    sentences = system_prompt(120).split(". ")
    return [". ".join(sentences[i % 97:i % 97 + 1 + (i * 7) % 12]) + "." for i in range(n)]


async def embed_all(url: str, model: str, items: list[str], batch: int,
                    concurrency: int) -> tuple[float, list[list[float]], int]:
    """(seconds, the vectors in order, prompt tokens) of embedding ``items`` in calls of
    ``batch``, ``concurrency`` calls at a time."""
    calls = [items[i:i + batch] for i in range(0, len(items), batch)]
    vectors: list[list[float] | None] = [None] * len(items)
    tokens = 0
    queue = list(enumerate(calls))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while queue:
            index, call = queue.pop(0)
            async with session.post(url + "/v1/embeddings", json={
                    "model": model, "input": call, "encoding_format": "float"}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {body}")
            for item in body["data"]:
                vectors[index * batch + item["index"]] = item["embedding"]
            tokens += body["usage"]["prompt_tokens"]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - start, vectors, tokens


def model_name(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def bench_system(system, port: int, items: list[str], rounds: int, log_dir: Path,
                 startup_timeout: float) -> dict:
    shapes, vectors = {}, None
    with served(system, port, log_dir, startup_timeout) as url:
        model = model_name(url)
        asyncio.run(embed_all(url, model, items[:32], 8, 2))  # warm-up
        for batch, concurrency in SHAPES:
            key = f"batch {batch} x {concurrency}"
            each = []
            for r in range(rounds):
                # a fresh first word per round and shape: no prefix-cache hits across them
                tagged = [f"({batch}.{r}) {text}" for text in items]
                seconds, vectors, tokens = asyncio.run(
                    embed_all(url, model, tagged, batch, concurrency))
                each.append({"seconds": seconds, "inputs_per_s": len(items) / seconds,
                             "tokens_per_s": tokens / seconds, "prompt_tokens": tokens})
            best = max(each, key=lambda r: r["inputs_per_s"])
            shapes[key] = {**best, "rounds": each}
            print(f"  {system.name} {key}: {best['inputs_per_s']:.1f} inputs/s, "
                  f"{best['tokens_per_s']:.0f} tokens/s", flush=True)
    return {"version": system.version, "command": " ".join(map(str, system.command)),
            "env": system.env, "shapes": shapes, "vectors": vectors}


def markdown(results: dict) -> str:
    systems = results["systems"]
    heron_shapes = systems.get("heron", {}).get("shapes", {})
    lines = [f"SmolLM2-135M-Instruct as an embedding model (last token, normalized, fp32), "
             f"{results['inputs']} texts ({results['prompt_tokens']} tokens), "
             f"{results['machine']['threads']} threads per system, best of {results['rounds']} "
             f"rounds, {results['date']}.", "",
             "| system | inputs per call x calls at a time | inputs/s | tokens/s | each round "
             "(inputs/s) | heron ÷ system |", "|---|---|---:|---:|---:|---:|"]
    for name, s in systems.items():
        for key, r in s.get("shapes", {}).items():
            mine = heron_shapes.get(key, {}).get("inputs_per_s")
            each = " / ".join(f"{x['inputs_per_s']:.1f}" for x in r["rounds"])
            lines.append(f"| {name} | {key} | {r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} "
                         f"| {each} | {mine / r['inputs_per_s']:.2f} |")
    if "least_cosine" in results:
        lines += ["", f"heron's and vLLM's vectors of the same texts: least cosine similarity "
                  f"{results['least_cosine']:.6f}, mean {results['mean_cosine']:.6f}."]
    lines += ["", "Versions and commands:", ""]
    lines += [f"- {name}: {s['version']}; `{s['command']}`; env {s['env']}"
              for name, s in systems.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="heron,vllm")
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()

    from heron.core.default_model import ensure_default_model
    from bench.peers.models import hf_dir
    gguf = ensure_default_model()
    items = texts(args.inputs)
    date = dt.datetime.now().replace(microsecond=0)
    stem = args.out / f"embeddings-{date.date()}"
    log_dir = stem.with_name(stem.name + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    results = {"date": date.isoformat(), "inputs": len(items), "rounds": args.rounds,
               "machine": {**describe(), "threads": args.threads}, "systems": {}}
    for name in args.systems.split(","):
        port = free_port()
        if name == "heron":
            system = heron(gguf, port, args.threads, 32)
            system.command += ["--set", 'model.task="embed"']
        elif name == "vllm":
            system = vllm(hf_dir(gguf), port, args.threads, 32)
            if system.missing:
                print(f"{name}: skipped ({system.missing})")
                continue
            system.command += ["--runner", "pooling", "--convert", "embed"]
        else:
            raise SystemExit(f"unknown system {name!r}")
        print(f"{name}: {system.version}", flush=True)
        results["systems"][name] = bench_system(system, port, items, args.rounds, log_dir,
                                                args.startup_timeout)
    systems = results["systems"]
    tokens = [s["shapes"][k]["prompt_tokens"] for s in systems.values() for k in s["shapes"]]
    results["prompt_tokens"] = tokens[0] if tokens else 0
    if {"heron", "vllm"} <= systems.keys():
        a, b = (np.array(systems[n]["vectors"]) for n in ("heron", "vllm"))
        cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        results["least_cosine"], results["mean_cosine"] = float(cosine.min()), float(cosine.mean())
    for s in systems.values():
        del s["vectors"]
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    stem.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
