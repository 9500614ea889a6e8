"""Encoder throughput: heron's bert family against transformers on a base-sized model.

A random-weight ``BertModel`` of bert-base's shape (12 layers, 768 wide, 12 heads: the shape
of bge-base and e5-base; no download), or with ``--model deberta-v3`` a ``DebertaV2Model``
of deberta-v3-base's (the same widths; relative positions on 256 log buckets, the shape of
the DeBERTa-v3 cross-encoders and NLI classifiers), or with ``--model nomic`` a
``NomicBertModel`` of nomic-embed-text-v1.5's (rotary positions, SwiGLU, no biases), saved
with a WordPiece tokenizer of its
vocabulary size. The same ``--inputs`` token-id inputs (``--min-len`` to ``--max-len`` tokens, CLS
pooling, L2-normalized, fp32 on the CPU) go through heron's ``Engine.embed`` (whole inputs
packed into steps of ``engine.max_num_batched_tokens``) and through transformers' model the
way sentence-transformers runs it (inputs sorted by length, padded batches of
``--batch``, SDPA). Each system's best of ``--rounds`` counts. Reports inputs/s, tokens/s,
heron ÷ transformers, and the least cosine similarity of the two systems' vectors. Writes
``bench/results/encoders-<model>-<date>.json`` and a markdown table (``.md``).

    python -m bench.encoders [--model bert|deberta-v3|nomic] [--inputs 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import describe

ROOT = Path(__file__).resolve().parent.parent


def model_config(name: str):
    import transformers
    if name == "bert":
        return transformers.BertConfig()  # bert-base-uncased's
    if name == "nomic":
        return transformers.NomicBertConfig()  # nomic-embed-text-v1.5's
    return transformers.DebertaV2Config(  # microsoft/deberta-v3-base's
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=128100, relative_attention=True, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, position_buckets=256, max_relative_positions=-1,
        norm_rel_ebd="layer_norm", share_att_key=True, type_vocab_size=0,
        layer_norm_eps=1e-7)


def save_model(directory: Path, config) -> None:
    """``config``'s shape, random weights (std 0.02, as BERT initializes), and a WordPiece
    tokenizer whose vocabulary is the model's (made-up pieces: the inputs are token ids)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).eval().save_pretrained(directory)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(
        config.vocab_size - len(specials))])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]",
                                         sep_token="[SEP]", pad_token="[PAD]",
                                         unk_token="[UNK]").save_pretrained(directory)


def inputs(n: int, low: int, high: int, vocab_size: int) -> list[list[int]]:
    """``n`` inputs of ``low`` to ``high`` tokens: [CLS], random pieces, [SEP]."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [[2, *torch.randint(5, vocab_size, (k - 2,), generator=g).tolist(), 3]
            for k in lengths]


def run_heron(path: Path, items: list[list[int]], rounds: int) -> tuple[list[float], list]:
    from heron.core.config import load_config
    from heron.core.engine import Engine
    engine = Engine(load_config(None, {"model.path": str(path), "model.device": "cpu",
                                       "model.dtype": "float32"}))
    engine.embed(items[:8])  # warm-up
    times, vectors = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        vectors = engine.embed(items)
        times.append(time.perf_counter() - start)
    return times, vectors


@torch.inference_mode()
def run_transformers(path: Path, items: list[list[int]], rounds: int,
                     batch: int) -> tuple[list[float], list]:
    import transformers
    model = transformers.AutoModel.from_pretrained(path).eval()  # BERT's: SDPA
    order = sorted(range(len(items)), key=lambda i: len(items[i]))

    def embed() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(items)
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            longest = max(len(items[i]) for i in chunk)
            ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(items[i])] = torch.tensor(items[i])
                mask[row, :len(items[i])] = 1
            cls = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
            for row, i in enumerate(chunk):
                out[i] = F.normalize(cls[row], dim=-1)
        return out

    embed()  # warm-up
    times, vectors = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        vectors = embed()
        times.append(time.perf_counter() - start)
    return times, vectors


def markdown(r: dict) -> str:
    lines = [f"A random-weight {r['model']}-base-shaped encoder (CLS pooling, normalized, "
             "fp32), "
             f"{r['inputs']} inputs of {r['min_len']}-{r['max_len']} tokens "
             f"({r['tokens']} tokens), {r['machine']['threads']} threads, best of "
             f"{r['rounds']} rounds, {r['date']}.", "",
             "| system | inputs/s | tokens/s | each round (s) | heron ÷ system |",
             "|---|---:|---:|---:|---:|"]
    mine = r["systems"]["heron"]["inputs_per_s"]
    for name, s in r["systems"].items():
        each = " / ".join(f"{t:.2f}" for t in s["seconds"])
        lines.append(f"| {name} | {s['inputs_per_s']:.1f} | {s['tokens_per_s']:.0f} | {each} "
                     f"| {mine / s['inputs_per_s']:.2f} |")
    lines += ["", f"Least cosine similarity of the two systems' vectors of the same input: "
              f"{r['least_cosine']:.6f}. transformers {r['transformers']}, torch "
              f"{r['machine']['torch']}; its batches: {r['batch']} inputs sorted by length "
              "(sentence-transformers' way)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert", "deberta-v3", "nomic"], default="bert")
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path, config = Path(tmp), model_config(args.model)
        save_model(path, config)
        items = inputs(args.inputs, args.min_len, args.max_len, config.vocab_size)
        tokens = sum(map(len, items))
        results = {"model": args.model,
                   "date": dt.datetime.now().replace(microsecond=0).isoformat(),
                   "inputs": len(items), "tokens": tokens, "min_len": args.min_len,
                   "max_len": args.max_len, "rounds": args.rounds, "batch": args.batch,
                   "transformers": transformers.__version__, "machine": describe(),
                   "systems": {}}
        outputs = {}
        for name, run in (("heron", lambda: run_heron(path, items, args.rounds)),
                          ("transformers", lambda: run_transformers(path, items, args.rounds,
                                                                    args.batch))):
            seconds, outputs[name] = run()
            best = min(seconds)
            results["systems"][name] = {"seconds": seconds, "inputs_per_s": len(items) / best,
                                        "tokens_per_s": tokens / best}
            print(f"{name}: {len(items) / best:.1f} inputs/s, {tokens / best:.0f} tokens/s",
                  flush=True)
    results["least_cosine"] = min(float(torch.dot(a, b)) for a, b in
                                  zip(outputs["heron"], outputs["transformers"]))
    stem = args.out / f"encoders-{args.model}-{results['date'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    stem.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
