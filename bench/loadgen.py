"""Load generator for any OpenAI-compatible server (heron, vLLM, llama.cpp, ...).

Sends a workload with streaming on, either at a fixed concurrency (that many requests always
open) or at a Poisson request rate (optionally capped at a concurrency), and measures each
request from the client's side:

- TTFT: request sent to first content chunk;
- ITL: gap between consecutive content chunks (one token each on the servers measured);
- TPOT: (last chunk - first chunk) / (output tokens - 1), per request;
- output tokens: the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
  else the number of content chunks.

Workloads: a JSON list or JSONL file of ``{"prompt": str}`` or ``{"messages": [...]}`` with
optional ``max_tokens`` and ``follow_ups`` (further user turns, each sent with the whole
conversation so far, answers included), or a built-in synthetic one: ``short-chat``,
``shared-prefix`` (one long system prompt, different questions), ``multi-turn`` (the long
system prompt, a question and three follow-ups per conversation), ``long-prompt`` (a ~1100-token
document of its own per request, then a question).

    python -m bench.loadgen --url http://127.0.0.1:8000 --workload short-chat \\
        --num-requests 64 --concurrency 8 --max-tokens 128 --ignore-eos --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench.workloads import FOLLOW_UPS, chat_prompts, policy_question, system_prompt

SYNTHETIC = ("short-chat", "shared-prefix", "multi-turn", "long-prompt")


@dataclass
class Request:
    """One request of a workload, or the first turn of a conversation."""

    max_tokens: int
    prompt: str | None = None           # /v1/completions
    messages: list[dict] | None = None  # /v1/chat/completions
    follow_ups: list[str] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups)


@dataclass
class Result:
    """The client's view of one request (one turn)."""

    ok: bool
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def synthetic(name: str, num_requests: int, max_tokens: int) -> list[Request]:
    if name == "short-chat":
        return [Request(max_tokens, messages=m) for m in chat_prompts(num_requests)]
    system = {"role": "system", "content": system_prompt(40)}
    if name == "shared-prefix":
        return [Request(max_tokens, messages=[system, {"role": "user",
                                                       "content": policy_question(i)}])
                for i in range(num_requests)]
    if name == "multi-turn":
        return [Request(max_tokens, messages=[system, {"role": "user",
                                                       "content": policy_question(i)}],
                        follow_ups=list(FOLLOW_UPS))
                for i in range(num_requests)]
    if name == "long-prompt":
        # A document of its own per request (~1100 tokens), as in retrieval-augmented chat:
        # nothing past the first sentence is shared, so every step reads long private contexts.
        return [Request(max_tokens, messages=[
                    {"role": "system", "content": system_prompt(64, seed=i)},
                    {"role": "user", "content": policy_question(i)}])
                for i in range(num_requests)]
    raise ValueError(f"unknown synthetic workload {name!r}")


def load_workload(source: str, num_requests: int | None, max_tokens: int) -> list[Request]:
    """A synthetic workload by name, or the requests in a JSON / JSONL file."""
    if source in SYNTHETIC:
        return synthetic(source, num_requests or 64, max_tokens)
    if not Path(source).is_file():
        raise ValueError(f"workload {source!r} is neither a file nor one of "
                         f"{', '.join(SYNTHETIC)}")
    text = Path(source).read_text()
    items = json.loads(text) if text.lstrip().startswith("[") else [
        json.loads(line) for line in text.splitlines() if line.strip()]
    requests = []
    for i, item in enumerate(items):
        if ("prompt" in item) == ("messages" in item):
            raise ValueError(f"{source}: item {i} needs exactly one of 'prompt', 'messages'")
        requests.append(Request(item.get("max_tokens", max_tokens), item.get("prompt"),
                                item.get("messages"), list(item.get("follow_ups", []))))
    return requests[:num_requests] if num_requests else requests


class Client:
    """Streams requests to one server and times them."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str,
                 ignore_eos: bool, extra_body: dict | None = None) -> None:
        self.session, self.url, self.model = session, url.rstrip("/"), model
        self.ignore_eos, self.extra_body = ignore_eos, extra_body or {}

    async def send(self, max_tokens: int, prompt: str | None = None,
                   messages: list[dict] | None = None) -> Result:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra_body}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if messages is not None:
            body["messages"], path = messages, "/v1/chat/completions"
        else:
            body["prompt"], path = prompt, "/v1/completions"
        start = time.perf_counter()
        stamps, pieces, usage = [], [], None
        try:
            async with self.session.post(self.url + path, json=body) as resp:
                if resp.status != 200:
                    return Result(False, f"http {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return Result(False, f"stream error: {chunk['error']}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                        if piece:
                            stamps.append(time.perf_counter())
                            pieces.append(piece)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            return Result(False, f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        if not stamps:
            return Result(False, "no output tokens")
        return Result(
            True, ttft=stamps[0] - start, latency=end - start,
            output_tokens=(usage or {}).get("completion_tokens") or len(stamps),
            prompt_tokens=(usage or {}).get("prompt_tokens") or 0,
            itl=[b - a for a, b in zip(stamps, stamps[1:])], text="".join(pieces))

    async def conversation(self, request: Request, on_result) -> None:
        """Sends the request, then each follow-up with the conversation so far."""
        messages = list(request.messages) if request.messages is not None else None
        prompt = request.prompt
        for turn in range(request.num_turns):
            if turn:
                if messages is None:  # a completions conversation continues the text
                    prompt += result.text + "\n" + request.follow_ups[turn - 1]
                else:
                    messages += [{"role": "assistant", "content": result.text},
                                 {"role": "user", "content": request.follow_ups[turn - 1]}]
            result = await self.send(request.max_tokens, prompt, messages)
            on_result(result)
            if not result.ok:
                return


def stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean / p50 / p90 / p99 (in ms by default); empty input gives None."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        values = values * 2
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"mean": statistics.fmean(values) * scale, "p50": q[49] * scale,
            "p90": q[89] * scale, "p99": q[98] * scale}


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    errors = Counter(r.error.split(":")[0] for r in results if not r.ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": dict(errors),
        "error_examples": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration, "requests_per_s": len(ok) / duration,
        "output_tokens": output, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens_per_s": output / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats([gap for r in ok for gap in r.itl]),
    }


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run(url: str, workload: list[Request], *, concurrency: int | None = None,
              request_rate: float | None = None, model: str | None = None,
              ignore_eos: bool = False, extra_body: dict | None = None, seed: int = 0,
              progress: bool = True, timeout_s: float = 3600,
              on_text: Callable[[str], None] | None = None) -> dict:
    """Sends ``workload`` and returns the summary (see `summarize`), plus the settings.

    ``concurrency`` alone: that many conversations always open. ``request_rate``: Poisson
    arrivals (requests/s), at most ``concurrency`` open when both are given. ``on_text``
    gets the text of every answer that succeeded.
    """
    if concurrency is None and request_rate is None:
        raise ValueError("give a concurrency, a request rate, or both")
    results: list[Result] = []
    bar = tqdm(total=sum(r.num_turns for r in workload), disable=not progress, unit="req",
               leave=False)

    def on_result(result: Result) -> None:
        results.append(result)
        bar.update()
        if on_text is not None and result.ok:
            on_text(result.text)

    # A fresh connection per request: some servers close a kept-alive one after a stream.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = model or await first_model(session, url)
        client = Client(session, url, model, ignore_eos, extra_body)
        start = time.perf_counter()
        if request_rate is None:
            queue = list(reversed(workload))

            async def worker() -> None:
                while queue:
                    await client.conversation(queue.pop(), on_result)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(workload)))))
        else:
            rng = random.Random(seed)
            limit = asyncio.Semaphore(concurrency or len(workload))

            async def arrive(request: Request) -> None:
                async with limit:
                    await client.conversation(request, on_result)

            tasks = []
            for request in workload:
                tasks.append(asyncio.create_task(arrive(request)))
                await asyncio.sleep(rng.expovariate(request_rate))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return {"model": model, "concurrency": concurrency, "request_rate": request_rate,
            "ignore_eos": ignore_eos, **summarize(results, duration)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first of /v1/models")
    parser.add_argument("--workload", default="short-chat",
                        help=f"a JSON/JSONL file or one of {', '.join(SYNTHETIC)}")
    parser.add_argument("--num-requests", type=int, help="default: 64 synthetic, all of a file")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="for requests that do not set their own")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate max_tokens every time")
    parser.add_argument("--seed", type=int, default=0, help="of the Poisson arrivals")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = parser.parse_args()
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1
    workload = load_workload(args.workload, args.num_requests, args.max_tokens)
    summary = asyncio.run(run(args.url, workload, concurrency=args.concurrency,
                              request_rate=args.request_rate, model=args.model,
                              ignore_eos=args.ignore_eos, seed=args.seed))
    summary["workload"] = args.workload
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
