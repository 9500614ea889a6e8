"""Speculative decoding on SmolLM2 (the default model): drafts vs none, one run.

Two workloads, greedy, chat template, ``--max-tokens`` tokens per answer:

- ``edit``, input-grounded: correct the spelling of a given paragraph (the answer mostly
  quotes the input, which n-gram lookup finds);
- ``write``, open-ended: short pieces on subjects and in forms that ``heron train-mtp``'s
  prompts do not use (nothing to look up; the MTP head must predict the model).

Variants: none, each of ``--methods``, and the settings below. Each variant has its engine,
all built first; after one untimed round, ``--repeats`` timed rounds in which every
workload and mode runs on every variant back to back, so that the machine's slow spells fall
on a cell's variants alike. The modes: single-stream (one request at a time) and
``--concurrency`` requests at once. Measured: decode tokens/s (from the step that gave a
group of requests its last first token to the group's end: prefill is the same with drafts
or without) and tokens/s with prefill; for the drafting methods the acceptance rate, the
acceptance per draft position, the mean accepted length, and the speedup over none: the
median of the rounds' ratios (decode, and with prefill). Answers with drafts must equal the
answers without. JSON to bench/results/speculative-<date>.json. Method ``mtp`` drafts with
the head ``--mtp-head`` (``make bench-speculative`` trains it once with ``heron
train-mtp``), once for each ``--confidence-thresholds`` value, its projections in
``--draft-dtype``; with ``--disable-by-batch-size N`` each method runs once more without
drafts in steps of more than N sequences; with ``--prompt-lookup`` mtp runs once more with
prompt lookup first. With ``--prefix-cache`` every run has the prefix cache on (the timed
rounds hit it), the MTP head keeping ``--prefix-store-mb`` of its K/V of prompt blocks for
them.

    python -m bench.speculative [--methods ngram mtp] [--mtp-head H] [--num-speculative-tokens 3]
        [--confidence-thresholds 0 0.2] [--disable-by-batch-size 4]
        [--draft-dtype bfloat16] [--prompt-lookup] [--repeats 3] [--prefix-cache]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.machine import describe

if TYPE_CHECKING:
    from heron.core.speculative import SpecStats

ROOT = Path(__file__).resolve().parent.parent

PARAGRAPHS = [
    "Teh river flowed slowly thru the valley, carrying leafs and small branchs toward the "
    "sea. On its banks, farmers had planted rows of wheat that swayed in the wind.",
    "The comittee will meet on tuesday to discus the budget for next year. Every member "
    "should bring there notes and a list of questons about the new proposal.",
    "Our servr handles thousands of requests per secound, but latency spikes when the cache "
    "is cold. We plan to add a warmup step befor traffic is routed to a new node.",
    "She packed her bags, locked the dor, and walked to the station in the early mornign "
    "light. The train was late, so she read a chapter of her favorit book.",
    "Photosynthesis converts light energy into chemical energy stored in glucose. Plants "
    "absorb carbon dioxide and water, and they releese oxygen as a byproduct.",
    "The library extended it's opening hours during exams, and students filled every tabel "
    "from morning until midnight, studying quietly for there finals.",
    "To bake the bread, mix flour, water, salt and yeast, then let the dough rise for two "
    "ours. Shape it, let it rise again, and bake it in a hot oven until golden.",
    "The old lighthouse stood on the rocky point for more then a century, guiding ships "
    "safely past the reef thru storms and fog alike.",
]


# held out from heron.plugins.mtp.prompts (checked in `main`)
WRITE_SUBJECTS = ["kites", "the postal service", "glass blowing", "river otters",
                  "the metric system", "origami", "street lamps", "honey badgers"]
WRITE_FORMS = ["Describe {} in a few sentences.", "What should a beginner know about {}?"]


def workload_prompts(name: str) -> list[str]:
    """The user messages of workload ``name``."""
    if name == "edit":
        return [f"Fix the spelling mistakes in this text and write it out again:\n\n{p}"
                for p in PARAGRAPHS]
    return [WRITE_FORMS[i % 2].format(s) for i, s in enumerate(WRITE_SUBJECTS)]


def run(engine, prompts, params, concurrency: int) -> dict:
    """``prompts`` in groups of ``concurrency`` run together: the answers, the seconds in
    all, and the decode part (prefill is the same with drafts or without): the seconds from
    the end of the step that gave a group's last first token to the group's end, and the
    tokens emitted in them."""
    outputs, decode_seconds, decode_tokens = [], 0.0, 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = prompts[i:i + concurrency]
        ids = [f"{i}-{j}" for j in range(len(group))]
        for rid, prompt in zip(ids, group):
            engine.add_request(rid, prompt, params)
        answers: dict[str, list[int]] = {}  # so far
        finished, decoding_since, prefilled = 0, None, 0
        while finished < len(ids):
            for out in engine.step():
                answers[out.request_id] = out.outputs[0].token_ids
                finished += out.finished
            if decoding_since is None and len(answers) == len(ids):
                decoding_since = time.perf_counter()
                prefilled = sum(map(len, answers.values()))
        decode_seconds += time.perf_counter() - decoding_since
        decode_tokens += sum(map(len, answers.values())) - prefilled
        outputs += [answers[rid] for rid in ids]
    return {"outputs": outputs, "seconds": time.perf_counter() - start,
            "decode_seconds": decode_seconds, "decode_tokens": decode_tokens}


def draft_counts(s: SpecStats) -> dict:
    """A run's drafting counts and rates; with prompt_lookup, also each part's."""
    counts = dict(drafts=s.drafts, draft_tokens=s.draft_tokens,
                  accepted_tokens=s.accepted_tokens, acceptance_rate=s.acceptance_rate,
                  acceptance_per_position=[a / max(s.drafts, 1) for a in s.accepted_at],
                  mean_accepted_length=s.mean_accepted_length)
    if s.by_source:
        counts["by_source"] = {name: draft_counts(part) for name, part in s.by_source.items()}
    return counts


def build_engine(model_path: Path, concurrency: int, method: str = "", k: int = 3,
                 mtp_head: Path | None = None, threshold: float = 0.0,
                 disable_by_batch_size: int = 0, draft_dtype: str = "auto",
                 prompt_lookup: bool = False, prefix_cache: bool = False,
                 prefix_store_mb: float = 64.0):
    from heron.core import Engine, load_config

    return Engine(load_config(None, {
        "model.path": str(model_path), "model.dtype": "float32", "model.device": "cpu",
        # every variant's engine lives through the whole run: a small KV pool each
        "engine.kv_cache_memory_gb": 0.25, "model.max_model_len": 2048,
        "engine.max_num_seqs": concurrency,
        # with the prefix cache the timed rounds hit it: prefill is skipped, and the MTP
        # head reads the prompt's K/V from its prefix store (prefix_store_mb)
        "prefix_cache.enabled": prefix_cache, "speculative.prefix_store_mb": prefix_store_mb,
        "speculative.method": method, "speculative.num_speculative_tokens": k,
        "speculative.confidence_threshold": threshold,
        "speculative.disable_by_batch_size": disable_by_batch_size,
        "speculative.draft_dtype": draft_dtype, "speculative.prompt_lookup": prompt_lookup,
        "speculative.model": str(mtp_head) if method == "mtp" else ""}))


def variants(args) -> dict[str, dict]:
    """Each variant's name and `build_engine` settings: none first."""
    out = {"none": {}}
    for method in args.methods:
        for threshold in (args.confidence_thresholds if method == "mtp" else [0.0]):
            name = f"{method}, confidence >= {threshold}" if threshold else method
            out[name] = {"method": method, "threshold": threshold}
    if args.prompt_lookup and "mtp" in args.methods:
        out["mtp, prompt_lookup"] = {"method": "mtp", "prompt_lookup": True}
    if args.disable_by_batch_size:
        for method in args.methods:
            out[f"{method}, disable_by_batch_size = {args.disable_by_batch_size}"] = {
                "method": method, "disable_by_batch_size": args.disable_by_batch_size}
    for settings in out.values():
        if settings.get("method") == "mtp":
            settings.update(mtp_head=args.mtp_head, draft_dtype=args.draft_dtype,
                            prefix_store_mb=args.prefix_store_mb)
    return out


def rates(rounds: list[dict]) -> tuple[list[float], list[float]]:
    """Each round's decode tokens/s and tokens/s with prefill."""
    return ([r["decode_tokens"] / r["decode_seconds"] for r in rounds],
            [sum(map(len, r["outputs"])) / r["seconds"] for r in rounds])


def summarise(rounds: list[dict], baseline: list[dict] | None, stats) -> dict:
    """One variant's cell (workload and mode) over the rounds: the median round's rates
    (decode, and with prefill), every round's, and the last round's drafting counts; with
    ``baseline`` (the rounds of the run without drafts), the speedup as the median of the
    rounds' ratios of rates (decode, and with prefill) and their range."""
    decode, whole = rates(rounds)
    entry = {"output_tokens": sum(map(len, rounds[-1]["outputs"])),
             "decode_tokens": rounds[-1]["decode_tokens"],
             "decode_tokens_per_s": statistics.median(decode),
             "tokens_per_s": statistics.median(whole),
             "rounds_decode_tokens_per_s": decode, "rounds_tokens_per_s": whole}
    if baseline is not None:
        base_decode, base_whole = rates(baseline)
        ratios = [r / b for r, b in zip(decode, base_decode)]
        entry.update(speedup=statistics.median(ratios), round_speedups=ratios,
                     end_to_end_speedup=statistics.median(
                         r / b for r, b in zip(whole, base_whole)),
                     **draft_counts(stats))
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["ngram"])
    parser.add_argument("--mtp-head", type=Path,
                        help="the MTP head for method mtp (`heron train-mtp --out ...`)")
    parser.add_argument("--workloads", nargs="+", choices=["edit", "write"],
                        default=["edit", "write"])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--confidence-thresholds", type=float, nargs="+", default=[0.0],
                        help="mtp runs once with each [speculative] confidence_threshold")
    parser.add_argument("--draft-dtype", default="auto",
                        help="[speculative] draft_dtype of the mtp runs")
    parser.add_argument("--disable-by-batch-size", type=int, default=0,
                        help="> 0: each method runs once more with this "
                             "[speculative] disable_by_batch_size")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="mtp runs once more with [speculative] prompt_lookup")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="every run with the prefix cache on (the timed rounds hit it)")
    parser.add_argument("--prefix-store-mb", type=float, default=64.0,
                        help="[speculative] prefix_store_mb of the mtp runs")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds, after one untimed; the median of their ratios "
                             "counts")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        f"speculative-{dt.date.today().isoformat()}.json")
    args = parser.parse_args()
    if "mtp" in args.methods and args.mtp_head is None:
        parser.error("method mtp needs --mtp-head")
    from heron.plugins.mtp.prompts import SUBJECTS
    if set(WRITE_SUBJECTS) & set(SUBJECTS):
        raise SystemExit("the write workload's subjects must be held out from train-mtp's")
    torch.set_num_threads(args.threads)
    from heron.core import SamplingParams
    from heron.core.default_model import ensure_default_model
    from heron.core.speculative import SpecStats
    model_path = ensure_default_model()

    settings = variants(args)
    engines = {name: build_engine(model_path, args.concurrency,
                                  k=args.num_speculative_tokens,
                                  prefix_cache=args.prefix_cache, **kw)
               for name, kw in settings.items()}
    chat = engines["none"].tokenizer.apply_chat_template
    prompts = {w: [chat([{"role": "user", "content": m}]) for m in workload_prompts(w)]
               for w in args.workloads}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    cells = [(f"{w}, {mode}", w, c) for w in args.workloads
             for mode, c in (("single", 1), (f"c={args.concurrency}", args.concurrency))]
    # Round 0 is untimed (oneDNN builds a kernel for each new row count once per process).
    # In each cell every variant runs back to back, so that the machine's slow spells,
    # which come and go over minutes, fall on a cell's variants alike.
    timed = {name: {cell: [] for cell, _, _ in cells} for name in engines}
    stats: dict[tuple[str, str], SpecStats] = {}
    for round_ in range(args.repeats + 1):
        for cell, workload, c in cells:
            for name, engine in engines.items():
                engine.spec_stats = SpecStats()  # this run's counts alone
                result = run(engine, prompts[workload], params, c)
                if round_:
                    timed[name][cell].append(result)
                    stats[name, cell] = engine.spec_stats
    runs = {}
    for name, cells_ in timed.items():
        runs[name] = {}
        for cell, rounds in cells_.items():
            base = timed["none"][cell]
            for r in rounds:
                if r["outputs"] != base[0]["outputs"]:
                    raise SystemExit(f"{name} {cell}: answers differ from those without drafts")
            entry = summarise(rounds, None if name == "none" else base, stats[name, cell])
            runs[name][cell] = entry
            if name == "none":
                continue
            print(f"{name} {cell}: decode {entry['decode_tokens_per_s']:.1f} tok/s vs "
                  f"{runs['none'][cell]['decode_tokens_per_s']:.1f} without, "
                  f"{entry['speedup']:.2f}x (rounds {min(entry['round_speedups']):.2f}-"
                  f"{max(entry['round_speedups']):.2f}x; with prefill "
                  f"{entry['end_to_end_speedup']:.2f}x); "
                  f"acceptance {entry['acceptance_rate']:.2f}, per position "
                  f"{[round(a, 2) for a in entry['acceptance_per_position']]}, mean accepted "
                  f"length {entry['mean_accepted_length']:.2f}", flush=True)
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "machine": describe(), "threads": args.threads,
              "model": model_path.name, "max_tokens": args.max_tokens,
              "num_speculative_tokens": args.num_speculative_tokens,
              "draft_dtype": args.draft_dtype, "repeats": args.repeats,
              "prompts": {w: workload_prompts(w) for w in args.workloads}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
