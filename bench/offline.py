"""Offline throughput: heron ``Engine.generate`` vs transformers ``generate`` on SmolLM2.

64 chat prompts x 128 greedy output tokens (EOS ignored, so both produce exactly the same
number of tokens), fp32 on the CPU. heron runs up to 32 sequences concurrently with
continuous batching; transformers runs static batches of 32 (left-padded, KV cache on).
Also single-sequence decode speed for both. Prints a table and writes JSON to
bench/results/offline-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from bench.machine import describe
from bench.workloads import chat_prompts


def bench_heron(model_path: Path, messages, max_tokens: int, max_seqs: int) -> dict:
    from heron.core.config import load_config
    from heron.core.engine import Engine
    from heron.core.sampling_params import SamplingParams

    engine = Engine(load_config(None, {
        "model.path": str(model_path), "model.dtype": "float32", "model.device": "cpu",
        "engine.max_num_seqs": max_seqs, "engine.max_num_batched_tokens": 2048}))
    prompts = [engine.tokenizer.apply_chat_template(m) for m in messages]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    single = engine.generate(prompts[:1], params)  # noqa: F841 - warm the single path
    start = time.perf_counter()
    single = engine.generate(prompts[:1], params)
    single_elapsed = time.perf_counter() - start
    return {"output_tokens": num_tokens, "seconds": elapsed,
            "tokens_per_s": num_tokens / elapsed,
            "single_decode_tokens_per_s": len(single[0].outputs[0].token_ids) / single_elapsed}


def bench_transformers(model_path: Path, messages, max_tokens: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": model_path.name}
    tok = AutoTokenizer.from_pretrained(model_path.parent, **kw)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, dtype=torch.float32,
                                                 **kw).eval()
    model.generation_config.eos_token_id = None  # never stop early: same token count as heron
    model.generation_config.pad_token_id = tok.pad_token_id or 0
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in messages]

    def run(batch: list[str]) -> int:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch)

    run(texts[:2])  # warm-up
    start = time.perf_counter()
    num_tokens = sum(run(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size))
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    single = run(texts[:1])
    single_elapsed = time.perf_counter() - start
    return {"output_tokens": num_tokens, "seconds": elapsed,
            "tokens_per_s": num_tokens / elapsed,
            "single_decode_tokens_per_s": single / single_elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    from heron.core.default_model import ensure_default_model
    model_path = ensure_default_model()
    messages = chat_prompts(args.num_prompts)
    results = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": describe(),
        "workload": {"prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "model": model_path.name,
                     "dtype": "float32", "greedy": True, "ignore_eos": True},
        "heron": bench_heron(model_path, messages, args.max_tokens, args.concurrency),
        "transformers": bench_transformers(model_path, messages, args.max_tokens,
                                           args.concurrency),
    }
    h, t = results["heron"], results["transformers"]
    results["ratio_tokens_per_s"] = h["tokens_per_s"] / t["tokens_per_s"]
    results["ratio_single_decode"] = h["single_decode_tokens_per_s"] / t["single_decode_tokens_per_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"offline-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'':14}{'heron':>10}{'transformers':>14}{'ratio':>8}")
    print(f"{'tokens/s':14}{h['tokens_per_s']:10.1f}{t['tokens_per_s']:14.1f}"
          f"{results['ratio_tokens_per_s']:8.2f}")
    print(f"{'single tok/s':14}{h['single_decode_tokens_per_s']:10.1f}"
          f"{t['single_decode_tokens_per_s']:14.1f}{results['ratio_single_decode']:8.2f}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
