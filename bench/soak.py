"""Soak test: many mixed requests against a real `heron serve`, with clients that walk away.

Builds a tiny random-weight Llama in a temporary directory, serves it from a subprocess and
sends ``--requests`` requests, ``--concurrency`` open at once: /v1/completions and
/v1/chat/completions, streamed or not, with random ``n``, ``max_tokens``, stop strings,
seeds, temperatures and ``cache_salt`` (a small pool, over prompts built from a few shared
prefixes, so the prefix cache sees hits). About ``--disconnect`` of the clients go away at a
random point: before the response, or mid-stream after a random number of chunks.

Every request that is not walked away from must come back well formed: 200, JSON that
parses, ``n`` choices each finished by ``stop`` or ``length``, usage; a stream must end with
``[DONE]`` and every event must parse. The server's RSS is sampled every second; after the
warm-up (``--warmup``) it must grow by no more than ``--max-rss-growth``. At the end the
engine must drain: no running or waiting requests, no KV blocks or state slots in use.

    python -m bench.soak --requests 10000 --concurrency 128 --out soak.json

Exits 1 on any error, malformed response, unfinished drain or server crash.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.compare import ROOT, free_port, wait_ready

PREFIXES = [
    "You are a careful assistant. Answer in one short sentence, and never guess. ",
    "Paged attention keeps KV blocks in a pool; the scheduler hands them out to sequences. ",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
WORDS = "fox dog block pool cache salt seed stream token prefix café 日本語 🚀 return".split()
STOPS = [".", "\n", "the", " a", "o", "!", "xyz"]
SALTS = ["alpha", "beta", "gamma"]
FINISH_REASONS = ("stop", "length")
GAUGES = ("heron_requests_running", "heron_requests_waiting", "heron_kv_blocks_in_use")


class Malformed(Exception):
    """The server answered, but not the way the API says it must."""


class HTTPFailure(Exception):
    """A status other than 200, with the error body's ``code`` (or ``type``)."""

    def __init__(self, status: int, code: str, text: str) -> None:
        super().__init__(f"{status} {code}: {text[:300]}")
        self.status, self.code = status, code


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    num_5xx: int = 0
    num_malformed: int = 0

    def error(self, kind: str, example: str) -> None:
        self.errors[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < 2:
            examples.append(example[:500])


def make_request(rng: random.Random, disconnect: float) -> dict:
    """One random request: where it goes, its body, and when (if ever) its client leaves."""
    is_chat = rng.random() < 0.5
    prompt = rng.choice(PREFIXES) + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    body = {"n": rng.randint(1, 3), "max_tokens": rng.randint(1, 32),
            "seed": rng.randrange(2**31), "temperature": round(rng.uniform(0.0, 1.5), 2),
            "stream": rng.random() < 0.5}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.7:
        body["cache_salt"] = rng.choice(SALTS)
    if is_chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    leave = None
    if rng.random() < disconnect:
        # mid-stream after k events, or before the response after a random delay
        leave = ("after_events", rng.randint(1, 8)) if body["stream"] and rng.random() < 0.6 \
            else ("after_s", rng.uniform(0.0, 1.0))
    return {"path": "/v1/chat/completions" if is_chat else "/v1/completions",
            "body": body, "leave": leave}


def check_usage(usage, body: dict) -> None:
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int) \
            or not isinstance(usage.get("completion_tokens"), int):
        raise Malformed(f"bad usage {usage!r}")
    if usage["prompt_tokens"] <= 0 or usage["completion_tokens"] > body["n"] * body["max_tokens"]:
        raise Malformed(f"usage out of range {usage!r} for n={body['n']} "
                        f"max_tokens={body['max_tokens']}")


def check_full(data: dict, body: dict, is_chat: bool) -> None:
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != body["n"]:
        raise Malformed(f"{len(choices or [])} choices for n={body['n']}")
    if sorted(c.get("index") for c in choices) != list(range(body["n"])):
        raise Malformed(f"choice indices {[c.get('index') for c in choices]}")
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            raise Malformed(f"finish_reason {c.get('finish_reason')!r}")
        text = c.get("message", {}).get("content") if is_chat else c.get("text")
        if not isinstance(text, str):
            raise Malformed(f"no text in choice {c!r}")
    check_usage(data.get("usage"), body)


async def read_stream(resp: aiohttp.ClientResponse, body: dict, leave_after: int | None
                      ) -> bool:
    """Read and check a stream; False when the client left it after ``leave_after`` events."""
    finished, usage, num_events, is_done = {}, None, 0, False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        if not line.startswith("data: "):
            raise Malformed(f"not an SSE data line: {line[:200]!r}")
        if is_done:
            raise Malformed("event after [DONE]")
        payload = line[len("data: "):]
        if payload == "[DONE]":
            is_done = True
            continue
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as e:
            raise Malformed(f"event does not parse: {payload[:200]!r}") from e
        if "error" in event:
            raise Malformed(f"error event {event['error']}")
        for c in event.get("choices", []):
            if c.get("finish_reason") is not None:
                if c["finish_reason"] not in FINISH_REASONS or c.get("index") in finished:
                    raise Malformed(f"finish_reason {c['finish_reason']!r} "
                                    f"for choice {c.get('index')}")
                finished[c.get("index")] = c["finish_reason"]
        if event.get("usage"):
            usage = event["usage"]
        num_events += 1
        if leave_after is not None and num_events >= leave_after:
            resp.close()  # drop the connection mid-stream
            return False
    if not is_done:
        raise Malformed(f"stream ended without [DONE] after {num_events} events")
    if sorted(finished) != list(range(body["n"])):
        raise Malformed(f"finished choices {sorted(finished)} for n={body['n']}")
    check_usage(usage, body)
    return True


async def send(session: aiohttp.ClientSession, url: str, req: dict) -> bool:
    """Send one request and check the answer; False when its client left early."""
    body, leave = req["body"], req["leave"]
    async with session.post(url + req["path"], json=body) as resp:
        if resp.status != 200:
            text = await resp.text()
            try:
                err = json.loads(text)["error"]
                code = err.get("code") or err.get("type")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = "unparsed-body"
            raise HTTPFailure(resp.status, code, text)
        if body["stream"]:
            leave_after = leave[1] if leave and leave[0] == "after_events" else None
            return await read_stream(resp, body, leave_after)
        try:
            data = await resp.json()
        except (ValueError, aiohttp.ContentTypeError) as e:
            raise Malformed(f"body does not parse: {e}") from e
        check_full(data, body, req["path"].endswith("chat/completions"))
        return True


async def one(session, url: str, req: dict, tally: Tally, timeout_s: float) -> None:
    leave = req["leave"]
    limit = leave[1] if leave and leave[0] == "after_s" else timeout_s
    tally.sent += 1
    try:
        is_complete = await asyncio.wait_for(send(session, url, req), limit)
    except asyncio.TimeoutError:
        if leave and leave[0] == "after_s":
            tally.disconnected += 1  # cancelled: aiohttp closes the connection
        else:
            tally.error("timeout", json.dumps(req))
        return
    except HTTPFailure as e:
        tally.num_5xx += e.status >= 500
        tally.error(f"http {e.status} {e.code}", f"{e} | request {json.dumps(req)}")
        return
    except Malformed as e:
        tally.num_malformed += 1
        tally.error(f"malformed ({req['path']}, stream={req['body']['stream']})",
                    f"{e} | request {json.dumps(req)}")
        return
    except (aiohttp.ClientError, OSError) as e:
        tally.error(f"exception {type(e).__name__}", f"{e!r} | request {json.dumps(req)}")
        return
    if is_complete:
        tally.completed += 1
    else:
        tally.disconnected += 1


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def sample_rss(pid: int, tally: Tally, samples: list) -> None:
    """``(seconds, requests finished, RSS MiB)`` every second until cancelled."""
    start = time.monotonic()
    while True:
        rss = rss_mib(pid)
        if rss is not None:
            done = tally.completed + tally.disconnected + sum(tally.errors.values())
            samples.append((round(time.monotonic() - start, 1), done, round(rss, 1)))
        await asyncio.sleep(1.0)


async def drive(url: str, pid: int, args) -> tuple[Tally, list, float]:
    rng = random.Random(args.seed)
    requests = [make_request(rng, args.disconnect) for _ in range(args.requests)]
    tally, samples = Tally(), []
    semaphore = asyncio.Semaphore(args.concurrency)
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)

    async def guarded(session, req):
        async with semaphore:
            await one(session, url, req, tally, args.request_timeout)

    sampler = asyncio.create_task(sample_rss(pid, tally, samples))
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(guarded(session, r)) for r in requests]
        for i, task in enumerate(asyncio.as_completed(tasks), 1):
            await task
            if i % max(1, args.requests // 20) == 0:
                print(f"  {i}/{args.requests} done, {time.perf_counter() - start:.0f} s, "
                      f"RSS {samples[-1][2] if samples else '?'} MiB", flush=True)
    duration = time.perf_counter() - start
    sampler.cancel()
    return tally, samples, duration


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_drained(url: str, timeout_s: float) -> dict[str, float]:
    """The final engine gauges, once all of GAUGES (and any *_slots_in_use) read 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(url)
        gauges = {k: v for k, v in values.items()
                  if k in GAUGES or k.endswith("_slots_in_use") or k in (
                      "heron_requests_swapped", "heron_kv_blocks_cached",
                      "heron_kv_blocks_total", "heron_preemptions_total",
                      "heron_prefix_cache_hit_tokens_total",
                      "heron_prefix_cache_queried_tokens_total")
                  or k.startswith(("heron_requests_finished_total{",
                                   "heron_requests_rejected_total{"))}
        busy = [k for k in gauges if (k in GAUGES or k.endswith("_slots_in_use")) and gauges[k]]
        if not busy or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def server_command(model: Path, port: int, args) -> list[str]:
    settings = {
        "model.dtype": '"float32"', "model.device": '"cpu"',
        "engine.max_num_seqs": args.max_num_seqs, "engine.num_kv_blocks": 16384,
        "engine.max_num_batched_tokens": 4096,
        "server.max_waiting_requests": args.concurrency * 4,
        "logging.level": '"warning"', "logging.format": '"json"',
        "logging.log_requests": "false",
    }
    if args.threads:
        settings["model.num_threads"] = args.threads
    settings.update(kv.split("=", 1) for kv in args.set)
    command = [sys.executable, "-m", "heron.server.cli", "serve", str(model), "--port", str(port)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    return command


def log_problems(log_path: Path, limit: int = 5) -> tuple[int, list[str]]:
    """Lines of the server log at error level or with a traceback, and the first few."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines()
             if '"error"' in line or "Traceback" in line or "exception" in line.lower()]
    return len(lines), [line[:600] for line in lines[:limit]]


def summarize(tally: Tally, samples: list, duration: float, gauges: dict, args,
              returncode: int | None, log_path: Path) -> dict:
    warm_at = int(args.requests * args.warmup)
    warm = next((s[2] for s in samples if s[1] >= warm_at), None)
    end = samples[-1][2] if samples else None
    growth = (end - warm) / warm if warm and end else None
    num_log_problems, log_examples = log_problems(log_path)
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
        "sent": tally.sent, "completed": tally.completed,
        "disconnected_by_client": tally.disconnected,
        "errors": sum(tally.errors.values()), "errors_by_kind": dict(tally.errors),
        "error_examples": tally.examples, "num_5xx": tally.num_5xx,
        "num_malformed": tally.num_malformed,
        "duration_s": round(duration, 1), "requests_per_s": round(tally.sent / duration, 1),
        "rss_mib": {"warm": warm, "end": end, "max": max((s[2] for s in samples), default=None),
                    "growth_after_warmup": None if growth is None else round(growth, 4)},
        "rss_flat": growth is not None and growth <= args.max_rss_growth,
        # (seconds, requests finished, RSS MiB) every ~10 s: leaks and slow-downs show here
        "timeline": samples[::10] + samples[-1:],
        "final_gauges": gauges, "server_returncode": returncode,
        "server_log": str(log_path), "server_log_problem_lines": num_log_problems,
        "server_log_examples": log_examples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--disconnect", type=float, default=0.2,
                        help="share of clients that leave early")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    # shape-keyed caches (oneDNN's primitives, the allocator's pools) fill over the first
    # few thousand requests, then stay
    parser.add_argument("--warmup", type=float, default=0.4,
                        help="share of the requests after which RSS must stay flat")
    parser.add_argument("--max-rss-growth", type=float, default=0.05,
                        help="largest relative RSS growth after the warm-up")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra server setting (a TOML literal), e.g. engine.max_num_seqs=64")
    parser.add_argument("--out", type=Path,
                        default=ROOT / f"bench/results/soak-{dt.date.today().isoformat()}.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".log")

    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import build_tiny

    with tempfile.TemporaryDirectory(prefix="heron-soak-") as tmp:
        model = Path(tmp) / "tiny-llama"
        build_tiny("llama", model, std=0.15)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with log_path.open("w") as log:
            proc = subprocess.Popen(server_command(model, port, args), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(url, proc, 120)
            print(f"server pid {proc.pid} on {url}; log {log_path}", flush=True)
            tally, samples, duration = asyncio.run(drive(url, proc.pid, args))
            gauges = wait_drained(url, 30) if proc.poll() is None else {}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    # NOTE: a crash shows as a signal (negative); a clean SIGTERM shutdown exits 0
    result = summarize(tally, samples, duration, gauges, args, proc.returncode, log_path)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print(f"sent {result['sent']}, completed {result['completed']}, disconnected by client "
          f"{result['disconnected_by_client']}, errors {result['errors']}")
    for kind, count in tally.errors.most_common():
        print(f"  {count:6d}  {kind}\n          e.g. {tally.examples[kind][0][:300]}")
    print(f"{result['duration_s']} s, {result['requests_per_s']} requests/s")
    rss = result["rss_mib"]
    print(f"RSS MiB: after warm-up ({args.warmup:.0%}) {rss['warm']}, end {rss['end']}, "
          f"max {rss['max']}: {'flat' if result['rss_flat'] else 'GROWING'}")
    print("final gauges: " + ", ".join(f"{k}={v:g}" for k, v in sorted(gauges.items())))
    print(f"server exit code {proc.returncode}; {result['server_log_problem_lines']} "
          f"problem lines in {log_path}")
    print(f"wrote {args.out}")
    is_drained = gauges and not any(v for k, v in gauges.items()
                                    if k in GAUGES or k.endswith("_slots_in_use"))
    ok = not tally.errors and is_drained and result["rss_flat"] and proc.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
