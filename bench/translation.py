"""Translation throughput: heron's nllb family vs transformers ``generate``, one run.

A random-weight M2M100 shaped for a CPU (6 + 6 layers, d_model 512, 8 heads, FFN 2048) with
a tokenizer trained on made-up sentences (tests/nllb_models.py; no downloads), 64 source
sentences of 5-30 words, fp32 on the CPU, greedy and beam search (4 beams), two workloads:

- ``fixed``: EOS ignored by both, so every translation (and beam) is exactly
  ``--max-tokens`` long: both do the same decoder work, and nothing but per-step cost
  separates them.
- ``eos``: EOS honoured, translations end where the model picks EOS (its EOS logit is
  raised, ``--eos-boost``, so lengths spread from 1 to ``--max-tokens``): a batch of
  transformers runs until its longest translation ends, heron's continuous batching
  retires each as it ends.

In both, heron's translations must equal transformers' token for token: a sentence where they
differ must equal transformers' translation of it alone (padding a batch can flip a near-tie
between beams; ``equal_only_unpadded`` lists those).

heron runs every sentence concurrently; transformers runs batches of ``--batch-size``
sentences (padded, KV cache on). Each side runs the workload once to warm up, then the two
take turns, ``--repeats`` times each. Target tokens/s (of the returned translations, EOS
included) at each side's median time, and the ratio: the median of the rounds' ratios. JSON
to bench/results/translation-<date>.json.

    python -m bench.translation [--num-beams 1 4] [--workloads fixed eos]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
             decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
             max_position_embeddings=256)


def sources(num: int, seed: int = 0) -> list[str]:
    from tests.nllb_models import corpus
    words = " ".join(corpus(200, seed=seed)).split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(num)]


def timed(sides: dict, repeats: int) -> dict:
    """Each side's ``run()`` once untimed (a warm-up: memory first touched, caches filled),
    then ``repeats`` rounds in which every side runs once, in turn, so that a shared
    machine's slow spells fall on both sides alike. Per side: its last result as
    ``outputs``, the median time as ``seconds``, and every time."""
    for run in sides.values():
        run()
    times = {name: [] for name in sides}
    outputs = {}
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    return {name: {"outputs": outputs[name], "seconds": statistics.median(times[name]),
                   "runs": times[name]} for name in sides}


def heron_translator(path: Path, tok, tgt_id: int, max_tokens: int, num_beams: int,
                     ignore_eos: bool, max_num_seqs: int):
    """``translate(texts)``: heron's translations of ``texts``, all running at once."""
    from heron.core import Engine, SamplingParams, load_config

    engine = Engine(load_config(None, {
        "model.path": str(path), "model.dtype": "float32", "model.device": "cpu",
        "engine.max_num_seqs": max_num_seqs * num_beams,
        "engine.max_num_batched_tokens": 4096}))
    start_id = engine.runner.model.cfg.decoder_start_token_id
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                            num_beams=num_beams)

    def run(batch):
        for i, text in enumerate(batch):
            engine.add_request(f"r{i}", [start_id, tgt_id], params,
                               encoder_prompt=tok(text).input_ids)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                         if o.finished})
        return [done[f"r{i}"] for i in range(len(batch))]

    return run


def transformers_translator(model, tok, tgt_id: int, max_tokens: int, num_beams: int,
                            ignore_eos: bool):
    """``translate(texts, batch_size)``: transformers' translations of ``texts``, generated
    in padded batches of ``batch_size``."""
    eos = model.config.eos_token_id
    # the same budget as heron's: max_tokens after the forced target language
    kw = dict(num_beams=num_beams, do_sample=False, forced_bos_token_id=tgt_id,
              max_new_tokens=max_tokens + 1, eos_token_id=None if ignore_eos else eos)
    if ignore_eos:
        kw["min_new_tokens"] = max_tokens + 1

    def translations(out):  # after decoder start + language, through the first EOS
        rows = []
        for row in out[:, 2:].tolist():
            rows.append(row[:row.index(eos) + 1] if eos in row and not ignore_eos else row)
        return rows

    @torch.inference_mode()
    def translate(texts, batch_size):
        outputs = []
        for i in range(0, len(texts), batch_size):
            batch = tok(texts[i:i + batch_size], return_tensors="pt", padding=True)
            outputs += translations(model.generate(**batch, **kw))
        return outputs

    return translate


def unpadded_differences(translate, texts, heron: list, hf: list) -> list[int]:
    """The sentences whose translations differ. Padding a batch changes the rounding of
    transformers' sums (its attention runs over padded rows), which can flip a near-tie
    between two beams: each of these must then equal transformers' translation of the
    sentence alone, unpadded, or the run fails."""
    differ = [i for i, (a, b) in enumerate(zip(heron, hf)) if a != b]
    for i in differ:
        if translate([texts[i]], 1) != [heron[i]]:
            raise SystemExit(f"sentence {i}: heron's translation differs from transformers' "
                             "of the same sentence alone")
    return differ


def summary(run: dict) -> dict:
    lengths = [len(o) for o in run.pop("outputs")]
    tokens = sum(lengths)
    return {**run, "target_tokens": tokens, "tokens_per_s": tokens / run["seconds"],
            "lengths": {"min": min(lengths), "median": statistics.median(lengths),
                        "max": max(lengths)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workloads", nargs="+", choices=["fixed", "eos"],
                        default=["fixed", "eos"])
    parser.add_argument("--eos-boost", type=float, default=4.5)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds (each side runs once in each); medians count")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        f"translation-{dt.date.today().isoformat()}.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from tests.nllb_models import build_translator

    texts = sources(args.sentences)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="heron-translation-") as tmp:
        path = Path(tmp) / "m2m100"
        tok, model = build_translator(path, eos_boost=args.eos_boost, **SHAPE)
        tgt_id = tok.convert_tokens_to_ids("fra_Latn")
        for workload in args.workloads:
            for beams in args.num_beams:
                ignore_eos = workload == "fixed"
                ours = heron_translator(path, tok, tgt_id, args.max_tokens, beams, ignore_eos,
                                        len(texts))
                translate = transformers_translator(model, tok, tgt_id, args.max_tokens, beams,
                                                    ignore_eos)
                timing = timed({"heron": lambda: ours(texts),
                                "transformers": lambda: translate(texts, args.batch_size)},
                               args.repeats)
                heron, hf = timing["heron"], timing["transformers"]
                differ = unpadded_differences(translate, texts, heron["outputs"], hf["outputs"])
                heron, hf = summary(heron), {**summary(hf), "batch_size": args.batch_size}
                name = f"{workload}, num_beams={beams}"
                # both return the same translations: a round's ratio is one of times
                rounds = [t / h for h, t in zip(heron["runs"], hf["runs"])]
                runs[name] = {"heron": heron, "transformers": hf,
                              "ratio": statistics.median(rounds), "round_ratios": rounds,
                              "equal_only_unpadded": differ}
                print(f"{name}: heron {heron['tokens_per_s']:.1f} target tok/s, "
                      f"transformers {hf['tokens_per_s']:.1f} (batches of "
                      f"{args.batch_size}): {runs[name]['ratio']:.2f}x (rounds "
                      f"{min(rounds):.2f}-{max(rounds):.2f}x); lengths {heron['lengths']}",
                      flush=True)
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "machine": describe(), "threads": args.threads,
              "model": {"layers": "6+6", **SHAPE, "vocab": len(tok),
                        "eos_boost": args.eos_boost},
              "sentences": args.sentences, "max_tokens": args.max_tokens, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
