"""Multi-LoRA throughput: SmolLM2 serving 8 adapters at once vs the base model alone.

8 random rank-16 PEFT adapters on all seven linear projections, built with peft on
transformers' load of the same GGUF (A and B ~ N(0, 0.02), so outputs stay sane). 64 chat
prompts x 64 greedy output tokens (EOS ignored), the requests spread round-robin over the
8 adapters, vs the same 64 requests on the base model. One engine (max_num_seqs 32,
max_loras 8, fp32 on the CPU) runs both, offline through `Engine`, in alternating rounds.
Reports output tokens/s of each (best of the rounds) and their ratio (target >= 0.7).
Writes JSON to bench/results/lora-<date>.json.
Run from the repository root: ``python -m bench.lora`` (``make bench-lora``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import describe

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapters(model_path: Path, directory: Path, num: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                dtype=torch.float32)
    paths = {}
    for i in range(num):
        model = get_peft_model(copy.deepcopy(base), LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(ALL_LINEAR)))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:  # PEFT starts B at zero: a no-op adapter
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        paths[f"lora-{i}"] = str(directory / f"lora-{i}")
        model.save_pretrained(paths[f"lora-{i}"])
    return paths


def run(engine, tag: str, prompts: list[str], adapters: list[str | None], params) -> dict:
    """Submit every request at once, step until all finish; tokens/s and the outputs."""
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"{tag}-{i}", prompt, params, adapter=adapter)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    outs = [done[f"{tag}-{i}"].outputs[0] for i in range(len(prompts))]
    num_tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "_outs": outs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    from bench.offline import chat_prompts
    from heron.core.config import load_config
    from heron.core.default_model import ensure_default_model
    from heron.core.engine import Engine
    from heron.core.sampling_params import SamplingParams

    model_path = ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = build_adapters(model_path, Path(tmp), args.num_adapters, args.rank)
        engine = Engine(load_config(None, {
            "model.path": str(model_path), "model.dtype": "float32", "model.device": "cpu",
            "engine.max_num_seqs": args.concurrency, "engine.max_num_batched_tokens": 2048,
            "lora.adapters": adapters, "lora.max_loras": args.num_adapters,
            "lora.max_rank": args.rank}))
    names = list(adapters)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base_runs, lora_runs = [], []
    for round_ in range(args.rounds):  # alternate, so drift in machine load hits both
        # a round tag keeps one round's prompts out of the next one's prefix cache
        prompts = [engine.tokenizer.apply_chat_template(
            [{**m[0], "content": f"({round_ + 1}) {m[0]['content']}"}])
            for m in chat_prompts(args.num_prompts)]
        if round_ == 0:
            run(engine, "warm", prompts[:len(names) + 1], [None, *names], warm)  # load slots
        base_runs.append(run(engine, f"base{round_}", prompts, [None] * len(prompts), params))
        lora_runs.append(run(engine, f"lora{round_}", prompts,
                             [names[i % len(names)] for i in range(len(prompts))], params))
    base_outs, lora_outs = base_runs[0]["_outs"], lora_runs[0]["_outs"]
    differ = sum(b.token_ids != a.token_ids for b, a in zip(base_outs, lora_outs))
    for r in base_runs + lora_runs:
        del r["_outs"]
    base = max(base_runs, key=lambda r: r["tokens_per_s"])  # best of the rounds
    lora = max(lora_runs, key=lambda r: r["tokens_per_s"])
    results = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {**describe(),
                    # many small ops per step: LoRA slows far more than the base model
                    # when other processes compete for the cores
                    "load_avg_1m_at_end": os.getloadavg()[0]},
        "workload": {"prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "adapters": args.num_adapters,
                     "rank": args.rank, "targets": list(ALL_LINEAR), "model": model_path.name,
                     "dtype": "float32", "greedy": True, "ignore_eos": True},
        "base": base, "lora": lora,
        "rounds": {"base_tokens_per_s": [r["tokens_per_s"] for r in base_runs],
                   "lora_tokens_per_s": [r["tokens_per_s"] for r in lora_runs]},
        "ratio_tokens_per_s": lora["tokens_per_s"] / base["tokens_per_s"],
        "requests_whose_output_the_adapter_changed": differ,
        "sample_lora_output": lora_outs[0].text,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"lora-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'':16}{'tokens/s':>10}{'seconds':>10}")
    for label, r in (("base", base), (f"{args.num_adapters} adapters", lora)):
        print(f"{label:16}{r['tokens_per_s']:10.1f}{r['seconds']:10.1f}")
    print(f"ratio {results['ratio_tokens_per_s']:.2f} (target >= 0.7); adapter changed "
          f"{differ}/{len(prompts)} outputs")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
