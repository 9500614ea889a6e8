"""Multi-turn chat through the server, with the radix prefix cache on vs off, on SmolLM2.

16 conversations x 4 turns run concurrently against a real heron server (OpenAI client,
streaming, greedy, fp32 on the CPU). Every conversation starts with the same long system
prompt (a made-up company policy, ~700 tokens); turn k sends the system prompt, all earlier
user and assistant messages (the assistant's as the server answered them) and a new
question. So turn 1 shares the system prompt across conversations and later turns share
their whole history with the previous turn: the cache should turn most prompt tokens into
hits. Each run gets a fresh server and engine (cold cache); the workload is identical.
Reports TTFT (all turns and turns >= 2), wall time, prompt and cached tokens, the /metrics
hit rate, and whether both runs gave the same answers. Writes JSON to
bench/results/multiturn-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import aiohttp
import openai
import torch
from aiohttp import web

from bench.machine import describe
from bench.workloads import FOLLOW_UPS, policy_question, system_prompt

def percentile(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def one_turn(client: openai.AsyncOpenAI, model: str, messages, max_tokens: int) -> dict:
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start,  # empty answer
            "text": "".join(text), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0}


async def conversation(client, model, system: str, conv: int, turns: int, max_tokens: int):
    messages = [{"role": "system", "content": system}]
    questions = [policy_question(conv), *FOLLOW_UPS]
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": questions[turn % len(questions)]})
        result = await one_turn(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    return results


async def scrape(url: str) -> tuple[float, float]:
    """The prefix cache's (queried, hit) token counters from /metrics."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        body = await resp.text()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return (values["heron_prefix_cache_queried_tokens_total"],
            values["heron_prefix_cache_hit_tokens_total"])


async def run(model_path: Path, cache: bool, args, system: str) -> dict:
    from heron.core.config import load_config
    from heron.server.app import create_app

    config = load_config(None, {
        "model.path": str(model_path), "model.dtype": "float32", "model.device": "cpu",
        "engine.max_num_seqs": args.conversations, "engine.max_num_batched_tokens": 1024,
        "prefix_cache.enabled": cache, "logging.log_requests": False,
        "logging.level": "warning"})
    # Server and client share this loop; the engine steps in its own worker thread anyway.
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=600)

    try:
        model = (await client.models.list()).data[0].id
        # Warm-up (first-call overheads); its prompt shares no block with the workload, and
        # the /metrics counters are read as differences around the workload.
        await one_turn(client, model, [{"role": "user", "content": "Hi!"}], 4)
        queried0, hit0 = await scrape(url)
        start = time.perf_counter()
        convs = await asyncio.gather(*(
            conversation(client, model, system, c, args.turns, args.max_tokens)
            for c in range(args.conversations)))
        wall = time.perf_counter() - start
        queried1, hit1 = await scrape(url)
    finally:
        await client.close()
        await runner.cleanup()
    turns = [t for conv in convs for t in conv]
    later = [t["ttft"] for conv in convs for t in conv[1:]]
    ttfts = [t["ttft"] for t in turns]
    return {
        "ttft_mean_s": statistics.mean(ttfts), "ttft_p90_s": percentile(ttfts, 90),
        "ttft_later_mean_s": statistics.mean(later), "ttft_later_p90_s": percentile(later, 90),
        "wall_s": wall, "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "hit_rate": (hit1 - hit0) / (queried1 - queried0) if queried1 > queried0 else 0.0,
        "first_turn_prompt_tokens": min(conv[0]["prompt_tokens"] for conv in convs),
        "texts": [[t["text"] for t in conv] for conv in convs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-sentences", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    from heron.core.default_model import ensure_default_model
    model_path = ensure_default_model()
    system = system_prompt(args.system_sentences)
    on = asyncio.run(run(model_path, True, args, system))
    off = asyncio.run(run(model_path, False, args, system))
    pairs = [(a, b) for ca, cb in zip(on.pop("texts"), off.pop("texts")) for a, b in zip(ca, cb)]
    results = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": describe(),
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "max_tokens": args.max_tokens, "system_sentences": args.system_sentences,
                     "first_turn_prompt_tokens": on["first_turn_prompt_tokens"],
                     "model": model_path.name, "dtype": "float32", "greedy": True,
                     "max_num_batched_tokens": 1024},
        "cache_on": on, "cache_off": off,
        "ratio_on_off": {k: on[k] / off[k] for k in on if off[k]},
        "identical_texts": {"matched": sum(a == b for a, b in pairs), "total": len(pairs)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"multiturn-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")

    print(f"{'':22}{'cache on':>10}{'cache off':>11}{'on/off':>8}")
    for key, label, fmt in (
            ("ttft_mean_s", "TTFT mean (s)", ".3f"), ("ttft_p90_s", "TTFT p90 (s)", ".3f"),
            ("ttft_later_mean_s", "TTFT turn>=2 mean (s)", ".3f"),
            ("ttft_later_p90_s", "TTFT turn>=2 p90 (s)", ".3f"), ("wall_s", "wall (s)", ".1f"),
            ("prompt_tokens", "prompt tokens", "d"), ("cached_tokens", "cached tokens", "d"),
            ("hit_rate", "hit rate (/metrics)", ".3f")):
        ratio = f"{on[key] / off[key]:8.2f}" if off[key] else f"{'-':>8}"
        print(f"{label:22}{on[key]:10{fmt}}{off[key]:11{fmt}}{ratio}")
    same = results["identical_texts"]
    print(f"identical answers: {same['matched']}/{same['total']}   "
          f"(system prompt + first question: {on['first_turn_prompt_tokens']} tokens)")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
