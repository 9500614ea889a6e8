"""Prefix caching on a hybrid (Mamba2 + attention) model: Marconi vs block-level snapshots.

A synthetic multi-turn trace, replayed through heron's Engine four times with the same
snapshot memory: (a) no prefix cache, (b) a snapshot at every block boundary with LRU
eviction (how block-level engines cache SSM states), (c) Marconi admission (snapshots at
branch points and at the last block a sequence reached) with LRU, (d) Marconi admission
with flop-aware eviction. The trace: 32 conversations x 5 turns; 4 system prompts, each
shared by 8 conversations; every turn sends the whole history. Up to 8 requests run at
once; a conversation's next turn becomes ready when its previous one finished, and ready
turns start in a fixed round-robin order, so all four runs see the same arrivals.

The model is a random-weight Bamba (hybrid Mamba2 + attention) built from a transformers
config, fp32 on the CPU; its answers are noise, but the prefix structure, compute and
cache behaviour are real. Reports token hit rate, the share of prompt FLOPs saved and
TTFT (mean, p95). Writes JSON to bench/results/hybrid-cache-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import describe

CONFIGS = {
    "a_off": {"prefix_cache.enabled": False},
    "b_every_block_lru": {"prefix_cache.snapshot_admission": "every_block",
                          "prefix_cache.eviction": "lru"},
    "c_marconi_lru": {"prefix_cache.snapshot_admission": "marconi",
                      "prefix_cache.eviction": "lru"},
    "d_marconi_flop_aware": {"prefix_cache.snapshot_admission": "marconi",
                             "prefix_cache.eviction": "flop_aware"},
}


def build_model(directory: Path, vocab: int) -> None:
    import transformers
    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        attn_layer_indices=[3, 7], num_attention_heads=8, num_key_value_heads=4,
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64,
        max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.BambaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.save_pretrained(directory)


def make_trace(args) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn (the first turn starts with its
    conversation's system prompt)."""
    rng = random.Random(7)
    words = lambda n: [rng.randrange(3, args.vocab) for _ in range(n)]  # noqa: E731
    systems = [words(args.system_tokens) for _ in range(args.systems)]
    return [[(systems[c % args.systems] if t == 0 else []) + words(rng.randint(20, 60))
             for t in range(args.turns)] for c in range(args.conversations)]


def replay(model_dir: Path, overrides: dict, trace, args) -> dict:
    from heron.core.config import load_config
    from heron.core.engine import Engine
    from heron.core.sampling_params import SamplingParams

    engine = Engine(load_config(None, {
        "model.path": str(model_dir), "model.dtype": "float32", "model.device": "cpu",
        "engine.max_num_seqs": args.concurrency, "engine.max_num_batched_tokens": 1024,
        "engine.num_kv_blocks": 8192, "prefix_cache.num_snapshots": args.snapshots,
        **overrides}))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    history = [[] for _ in trace]
    next_turn = [0] * len(trace)
    in_flight: dict[str, tuple[int, float]] = {}
    ttft: list[float] = []
    prompt_tokens = cached_tokens = 0
    flops_total = flops_saved = 0.0
    flops = engine.runner.prefix_flops
    cursor = 0
    start = time.perf_counter()
    while any(t < args.turns for t in next_turn) or in_flight:
        busy = {c for c, _ in in_flight.values()}
        for _ in range(len(trace)):  # round-robin over ready conversations
            if len(in_flight) >= args.concurrency:
                break
            c, cursor = cursor, (cursor + 1) % len(trace)
            if c in busy or next_turn[c] >= args.turns:
                continue
            history[c] += trace[c][next_turn[c]]
            rid = f"c{c}-t{next_turn[c]}"
            engine.add_request(rid, list(history[c]), params)
            in_flight[rid] = (c, time.perf_counter())
            busy.add(c)
            next_turn[c] += 1
        for out in engine.step():
            c, t0 = in_flight[out.request_id]
            if out.outputs[0].new_token_ids and len(out.outputs[0].token_ids) == len(
                    out.outputs[0].new_token_ids):
                ttft.append(time.perf_counter() - t0)
            if out.finished:
                del in_flight[out.request_id]
                n = len(out.prompt_token_ids)
                prompt_tokens += n
                cached_tokens += out.num_cached_tokens
                flops_total += flops(n)
                flops_saved += flops(out.num_cached_tokens) if out.num_cached_tokens else 0.0
                history[c] += out.outputs[0].token_ids
    wall = time.perf_counter() - start
    assert engine.num_blocks_in_use == 0 and engine.states.slots.num_used == 0
    return {"token_hit_rate": cached_tokens / prompt_tokens,
            "flops_saved_share": flops_saved / flops_total,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p95_s": statistics.quantiles(ttft, n=20, method="inclusive")[18],
            "wall_s": wall, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "requests": len(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--snapshots", type=int, default=16,
                        help="snapshot pool size, the same for every cached run")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    trace = make_trace(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.vocab)
        for name, overrides in CONFIGS.items():
            results[name] = replay(Path(tmp), overrides, trace, args)
            print(name, {k: round(v, 4) for k, v in results[name].items()}, flush=True)
    b, d = results["b_every_block_lru"], results["d_marconi_flop_aware"]
    summary = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": describe(),
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
        "hit_rate_d_over_b": d["token_hit_rate"] / b["token_hit_rate"] if b["token_hit_rate"]
        else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"hybrid-cache-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'config':24}{'hit rate':>10}{'FLOPs saved':>13}{'TTFT mean':>11}"
          f"{'TTFT p95':>10}{'wall s':>8}")
    for name, r in results.items():
        print(f"{name:24}{r['token_hit_rate']:10.3f}{r['flops_saved_share']:13.3f}"
              f"{r['ttft_mean_s']:11.3f}{r['ttft_p95_s']:10.3f}{r['wall_s']:8.1f}")
    print(f"hit rate (d) / (b): {summary['hit_rate_d_over_b']}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
