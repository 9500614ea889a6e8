"""Training an MTP head for a transformer model by self-distillation (``heron train-mtp``).

1. heron generates answers to a few thousand prompts with the model itself (greedy, the
   prefix cache off), keeping the hidden states the model computed at every position
   (`HiddenRecorder`, a proposer that drafts nothing): the output of a layer three
   quarters of the way up, which the head reads, and the final ones, which give the
   model's own distributions. Half the prompts ask for texts on assorted subjects, the
   other half ask to edit, summarise or correct those answers
   (`heron.plugins.mtp.prompts`): what the model writes either way.
2. The draft vocabulary is the generated text's most frequent tokens (`draft_vocabulary`).
3. `MtpModule`, its decoder layer started from the model's last layer, learns to predict
   token ``j + 2`` from ``(h_j, t_{j+1})``, ``h_j`` that layer's output: the loss is the
   cross-entropy against the model's own next-token distribution at ``j + 1`` (over the
   draft vocabulary), on the generated positions only.
4. Copying: the model answers requests to write out again, corrected, texts it wrote by
   sampling (temperature 1, so the text is not what it would predict greedily), and the
   head goes on learning on those answers and a quarter of the first samples. Predicting
   is learnt quickly, copying slowly: without this stage a head barely uses the prompt.
5. The head is written in the DeepSeek-V3 layout, one file, for ``[speculative] model``.

Why not the final hidden state (``hidden_layer``; the layout's default): copying text from
the prompt takes the head's one attention layer finding where the token it was given
appeared before and reading the token after it, so the keys must say which token each
position holds. A small model's final hidden state says mostly what comes next; with it,
a head trained on copying still barely copied. On SmolLM2-135M (30 layers), heads trained
alike on the same samples agreed with the model on its answers correcting given
paragraphs 30% of the time reading the final states, 49% reading layer 16's output and
55% reading layer 22's (on writing answers among their samples: 56%, 54%, 59%).

A few subjects are held out: the head's agreement with the model on their answers
(`agreement`, what the first draft's acceptance will be) measures how well it generalises
rather than how well it remembers. The generated samples can be kept in a file and reused,
so that trying other training settings does not generate them again; a head trained before
(``init``) can go on to the copying stage alone.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from heron.core import Sequence
from heron.core.speculative import Proposer
from heron.plugins.mtp.module import MtpModule
from heron.plugins.mtp.prompts import SUBJECTS, copy_prompts, training_prompts

log = logging.getLogger(__name__)

VALIDATION_PROMPTS = 240


@dataclass
class Sample:
    tokens: list[int]        # prompt and output
    hidden: torch.Tensor     # [len(tokens) - 1, H]: the head's input at each position
    num_prompt_tokens: int
    # [len(tokens) - 1, H]: the final hidden states, when `hidden` holds another layer's
    final: torch.Tensor | None = None

    @property
    def teacher(self) -> torch.Tensor:
        """The final hidden states: the model's own distributions, through its head."""
        return self.hidden if self.final is None else self.final


class HiddenRecorder(Proposer):
    """Keeps every sequence's hidden states, those of ``hidden_layer`` (None: the final
    ones) and, for another layer, the final ones too; drafts nothing.

    The rows are copied into large chunks as they come. Kept as a small tensor per step and
    sequence, among the engine's short-lived temporaries, they fragment the heap: 1024
    prompts' 134k rows (300 MB) grew the process by 2.7 GB that way, by 0.5 GB in chunks."""

    needs_hidden_states = True
    CHUNK_ROWS = 1 << 15

    def __init__(self, hidden_layer: int | None = None) -> None:
        self.hidden_layers = (None,) if hidden_layer is None else (hidden_layer, None)
        self.seqs: dict[int, Sequence] = {}
        self.where: dict[int, dict[int, int]] = {}  # seq id -> position -> row of the store
        self.chunks: list[torch.Tensor] = []
        self.num_rows = 0

    def propose(self, seqs, k):
        return [[] for _ in seqs]

    def observe(self, seq, start, hidden):
        self.seqs[seq.seq_id] = seq
        where = self.where.setdefault(seq.seq_id, {})
        for i in range(hidden.shape[0]):
            chunk, row = divmod(self.num_rows, self.CHUNK_ROWS)
            if chunk == len(self.chunks):
                self.chunks.append(hidden.new_empty(self.CHUNK_ROWS, hidden.shape[1]))
            self.chunks[chunk][row] = hidden[i]
            where[start + i] = self.num_rows
            self.num_rows += 1

    def samples(self) -> list[Sample]:
        out = []
        for seq_id, seq in self.seqs.items():
            where = self.where[seq_id]
            n = len(seq.token_ids) - 1
            if n < 2 or any(j not in where for j in range(n)):
                continue
            rows = (divmod(where[j], self.CHUNK_ROWS) for j in range(n))
            hidden = torch.stack([self.chunks[c][r] for c, r in rows])
            if len(self.hidden_layers) == 1:
                out.append(Sample(list(seq.token_ids), hidden, seq.num_prompt_tokens))
            else:
                layer, final = hidden.chunk(2, -1)
                out.append(Sample(list(seq.token_ids), layer.contiguous(),
                                  seq.num_prompt_tokens, final.contiguous()))
        return out


def generate_samples(engine, prompts: list[str], max_tokens: int,
                     hidden_layer: int | None = None) -> list[Sample]:
    """The model's greedy answers to ``prompts`` with their hidden states (`HiddenRecorder`)."""
    from heron.core import SamplingParams
    recorder = HiddenRecorder(hidden_layer)
    engine.set_proposer(recorder)
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return recorder.samples()


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens most frequent in the samples' outputs (then prompts), ids
    ascending."""
    counts = Counter()
    for s in samples:
        counts.update(s.tokens[s.num_prompt_tokens:])
    ranked = [t for t, _ in counts.most_common(size)]
    if len(ranked) < size:
        prompt_counts = Counter(t for s in samples for t in s.tokens)
        ranked += [t for t, _ in prompt_counts.most_common() if t not in set(ranked)]
        ranked += [t for t in range(vocab_size) if t not in set(ranked)]
    return torch.tensor(sorted(ranked[:size]))


def _batches(samples: list[Sample], batch_size: int, rng: random.Random):
    """Samples of similar lengths together, right-padded (causal: padding never reaches
    the positions before it)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    return [[samples[i] for i in g] for g in groups]


def chain_mask(depths: int, length: int) -> torch.Tensor:
    """Attention among ``depths`` blocks of ``length`` rows: block 0 is the module run on
    the target's hidden states at positions ``0 .. length - 1``, block ``a`` the ``a``-th
    chained draft after each of them (row ``i`` at position ``i + a``). As when drafting,
    row ``i`` of block ``a`` sees block 0's rows up to ``i`` (the verified positions' K/V)
    and row ``i`` of blocks ``1 .. a`` (its own chain); True: attends."""
    i = torch.arange(length)
    causal = i[None, :] <= i[:, None]
    same = torch.eye(length, dtype=torch.bool)
    rows = [torch.cat([causal] + [same if b <= a else torch.zeros_like(same)
                                  for b in range(1, depths)], dim=1) for a in range(depths)]
    return torch.cat(rows, dim=0)


def agreement(module: MtpModule, samples: list[Sample]) -> float:
    """How often the module's first draft (from ``(h_j, t_{j+1})``) is the token the model
    chose at ``j + 2``, over the samples' generated tokens: its greedy first-draft
    acceptance."""
    hits = total = 0
    with torch.no_grad():
        for s in samples:
            m = len(s.tokens) - 2
            out = module(s.hidden[None, :m], torch.tensor([s.tokens[1:1 + m]]),
                         torch.arange(m), chain_mask(1, m))[0]
            best = module.logits(out).argmax(-1)
            if module.draft_ids is not None:
                best = module.draft_ids[best]
            counted = torch.arange(2, m + 2) >= s.num_prompt_tokens
            hits += int((best == torch.tensor(s.tokens[2:]))[counted].sum())
            total += int(counted.sum())
    return hits / max(total, 1)


def train(module: MtpModule, samples: list[Sample], epochs: int, lr: float = 1e-3,
          batch_size: int = 16, depth: int = 3, seed: int = 0) -> list[float]:
    """Fit ``module``; returns the mean loss of each epoch.

    Drafting chains the module on its own output, so it learns to: chained depth ``a``
    (of ``depth``) reads depth ``a - 1``'s output (`MtpModule.chained`) one position on,
    with the true token there, attends as drafting does (`chain_mask`) and predicts one
    token further; every depth's loss counts. The loss is the cross-entropy against the
    model's own next-token distribution over the draft vocabulary."""
    rng = random.Random(seed)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(samples) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    losses = []
    module.train()
    for epoch in range(epochs):
        total, count = 0.0, 0
        for group in _batches(samples, batch_size, rng):
            m = max(len(s.tokens) for s in group) - 2  # pairs j = 0 .. m - 1 of depth 0
            # padded so that every depth's rows index in range
            hidden = torch.zeros(len(group), m + depth, module.head.shape[1])
            final = torch.zeros_like(hidden)
            tokens = torch.zeros(len(group), m + depth + 1, dtype=torch.long)
            for b, s in enumerate(group):
                hidden[b, :len(s.tokens) - 1] = s.hidden
                final[b, :len(s.tokens) - 1] = s.teacher
                tokens[b, :len(s.tokens)] = torch.tensor(s.tokens)
            lengths = torch.tensor([len(s.tokens) for s in group])[:, None]
            prompts = torch.tensor([s.num_prompt_tokens for s in group])[:, None]
            loss, num = 0.0, 0
            inputs, words, positions = [hidden[:, :m]], [], []
            for a in range(depth):
                words.append(tokens[:, 1 + a:1 + a + m])
                positions.append(torch.arange(a, a + m))
                out = module(torch.cat(inputs, 1), torch.cat(words, 1), torch.cat(positions),
                             chain_mask(a + 1, m))[:, a * m:]
                predicted = torch.arange(a + 2, a + 2 + m)[None]  # the token each predicts
                mask = (predicted >= prompts) & (predicted < lengths)
                if not mask.any():
                    break
                with torch.no_grad():  # the model's own distribution over that token
                    teacher = final[:, 1 + a:1 + a + m][mask]
                    target = torch.softmax(F.linear(teacher, module.head), -1)
                loss = loss + F.cross_entropy(module.logits(out[mask]), target,
                                              reduction="sum")
                num += int(mask.sum())
                inputs.append(module.chained(out))
            loss = loss / num
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total, count = total + loss.item() * num, count + num
        losses.append(total / max(count, 1))
        log.info("epoch %d: loss %.4f", epoch + 1, losses[-1])
    module.eval()
    return losses


def new_module(hf_config, model, draft_ids: torch.Tensor | None,
               hidden_layer: int | None = None) -> MtpModule:
    """An `MtpModule` for heron's loaded transformer ``model`` (its embedding and head
    shared, frozen) reading the output of its layer ``hidden_layer`` (None: its final
    hidden states), its layer a copy of the model's last layer, ``eh_proj`` passing the
    hidden state through."""
    from heron.core.ops.linear import unpack_weight
    head = model.embed if model.cfg.tie_word_embeddings else unpack_weight(model.lm_head)
    if draft_ids is not None:
        head = head[draft_ids]
    module = MtpModule(hf_config, model.embed, head, draft_ids, hidden_layer=hidden_layer)
    with torch.no_grad():
        hidden = module.eh_proj.weight.shape[0]
        module.eh_proj.weight.zero_()
        module.eh_proj.weight[:, hidden:] = torch.eye(hidden)
        module.eh_proj.weight[:, :hidden] = 0.1 * torch.eye(hidden)
        last = model.layers[-1]
        layer = module.layer
        attn = layer.self_attn
        q, kv = model.shape.q_size, model.shape.kv_size
        qkv = unpack_weight(last.attn.qkv)
        attn.q_proj.weight.copy_(qkv[:q])
        attn.k_proj.weight.copy_(qkv[q:q + kv])
        attn.v_proj.weight.copy_(qkv[q + kv:])
        attn.o_proj.weight.copy_(unpack_weight(last.attn.o))
        gate_up = unpack_weight(last.gate_up)
        inter = gate_up.shape[0] // 2
        layer.mlp.gate_proj.weight.copy_(gate_up[:inter])
        layer.mlp.up_proj.weight.copy_(gate_up[inter:])
        layer.mlp.down_proj.weight.copy_(unpack_weight(last.down))
        layer.input_layernorm.weight.copy_(last.input_norm)
        layer.post_attention_layernorm.weight.copy_(last.post_norm)
        module.out_norm.weight.copy_(model.final_norm)
    return module


def load_module(path: Path, hf_config, model) -> MtpModule:
    """The head at ``path`` (DeepSeek-V3 layout, as `MtpModule.save` writes it) as a
    trainable `MtpModule` for heron's loaded transformer ``model``."""
    from safetensors.torch import load_file
    prefix = f"model.layers.{model.cfg.num_layers}."
    tensors = {k.removeprefix(prefix): v for k, v in load_file(str(path)).items()}
    hidden_layer = tensors.pop("hidden_layer", None)
    module = new_module(hf_config, model, tensors.pop("draft_token_ids", None),
                        None if hidden_layer is None else int(hidden_layer))
    tensors.pop("shared_head.head.weight", None)  # the model's rows, as new_module took them
    own = ("enorm.", "hnorm.", "eh_proj.")
    module.load_state_dict({"out_norm.weight" if k == "shared_head.norm.weight" else
                            k if k.startswith(own) else "layer." + k: v
                            for k, v in tensors.items()})
    return module


def hf_config(path: Path):
    """The transformers config of the checkpoint at ``path`` (HF directory or GGUF)."""
    from transformers import AutoConfig
    if path.suffix == ".gguf":
        from heron.core.model_loader import read_gguf
        from heron.plugins.transformer.gguf_loader import gguf_config
        config = gguf_config(read_gguf(path))
        return AutoConfig.for_model(config.pop("model_type"), **config)
    return AutoConfig.from_pretrained(path)


def _generate(engine, num_prompts: int, max_tokens: int, seed: int, subjects,
              hidden_layer: int | None) -> list[Sample]:
    """Writing samples on ``subjects`` and editing samples over their answers."""
    chat = engine.tokenizer.apply_chat_template
    first, second = training_prompts(num_prompts, seed, subjects)
    samples = generate_samples(engine, [chat([m]) for m in first], max_tokens, hidden_layer)
    texts = [engine.tokenizer.decode(s.tokens[s.num_prompt_tokens:]) for s in samples]
    return samples + generate_samples(engine, [chat([m]) for m in second(texts)], max_tokens,
                                      hidden_layer)


def _generate_copies(engine, num_prompts: int, max_tokens: int, seed: int, subjects,
                     hidden_layer: int | None) -> list[Sample]:
    """Answers that write out again, corrected, sampled answers on ``subjects``."""
    from heron.core import SamplingParams
    chat = engine.tokenizer.apply_chat_template
    first, _ = training_prompts(2 * num_prompts, seed, subjects)
    outs = engine.generate([chat([m]) for m in first], SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed))
    texts = [engine.tokenizer.decode(o.outputs[0].token_ids) for o in outs]
    return generate_samples(engine, [chat([m]) for m in copy_prompts(texts, seed)],
                            max_tokens, hidden_layer)


def resolve_hidden_layer(setting: int | str, num_layers: int) -> int | None:
    """The layer a new head reads (None: the final hidden states) for ``setting``."""
    if setting == "final":
        return None
    try:
        layer = max(1, 3 * num_layers // 4) if setting == "auto" else int(setting)
    except ValueError:
        raise ValueError(f"hidden_layer {setting!r}: a layer number, 'auto' or "
                         "'final'") from None
    if not 1 <= layer <= num_layers:
        raise ValueError(f"hidden_layer {setting!r}: the model has layers 1..{num_layers}")
    return None if layer == num_layers else layer


def _check_settings(out: Path, **counts: int) -> None:
    """Refuse bad settings before an hour of work, not after it."""
    low = {"num_copy_prompts": 0, "draft_vocab": 0}
    for name, value in counts.items():
        if value < low.get(name, 1):
            raise ValueError(f"{name} must be >= {low.get(name, 1)} (got {value})")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name the .safetensors file to write")


def train_mtp(model_path: Path, out: Path, *, num_prompts: int = 3000,
              max_tokens: int = 96, draft_vocab: int = 4096, epochs: int = 4,
              lr: float = 3e-3, depth: int = 2, batch_size: int = 4,
              num_copy_prompts: int = 512, copy_epochs: int = 12, copy_lr: float = 2e-3,
              max_num_seqs: int = 128, seed: int = 0, held_out: int = 8,
              hidden_layer: int | str = "auto", samples_file: Path | None = None,
              init: Path | None = None) -> dict:
    """The whole recipe (module docstring): writes the head to ``out`` (one safetensors
    file) and returns what it measured. The head reads the output of the model's layer
    ``hidden_layer``: a number from 1, ``"auto"`` (``3 * num_layers // 4``) or ``"final"``
    (the final hidden states, as DeepSeek-V3's heads do). ``held_out`` subjects are kept
    for measuring `agreement`; ``samples_file`` keeps the generated samples (read instead
    of generating when it holds those of the same model and settings). With ``init`` (a
    head this recipe wrote) only the copying stage runs, on that head, which reads the
    layer it was trained on."""
    from heron.core import Engine, load_config
    from heron.plugins.transformer.model import TransformerModel

    _check_settings(out, num_prompts=num_prompts, max_tokens=max_tokens, epochs=epochs,
                    depth=depth, batch_size=batch_size, copy_epochs=copy_epochs,
                    num_copy_prompts=num_copy_prompts, draft_vocab=draft_vocab)
    started = time.perf_counter()
    engine = Engine(load_config(None, {
        "model.path": str(model_path), "model.dtype": "float32", "model.device": "cpu",
        "prefix_cache.enabled": False, "engine.max_num_seqs": max_num_seqs,
        "engine.max_num_batched_tokens": 2048}))
    if not isinstance(engine.runner.model, TransformerModel):
        raise ValueError(f"{model_path}: train-mtp trains heads for transformer models; this "
                         f"one runs on {type(engine.runner).__name__}")
    model = engine.runner.model
    module = load_module(init, hf_config(model_path), model) if init is not None else None
    layer = module.hidden_layer if module is not None else \
        resolve_hidden_layer(hidden_layer, model.cfg.num_layers)
    subjects = list(SUBJECTS)
    random.Random(seed).shuffle(subjects)
    kept, trained_on = subjects[:held_out], subjects[held_out:]
    key = {"model": str(model_path), "prompts": num_prompts, "max_tokens": max_tokens,
           "seed": seed, "held_out": kept, "hidden_layer": layer}
    copy_key = {**key, "copy_prompts": num_copy_prompts}
    cached = torch.load(samples_file, weights_only=False) \
        if samples_file is not None and samples_file.exists() else {}
    if cached.get("key") == key:
        log.info("%d samples read from %s", len(cached["samples"]), samples_file)
    else:
        cached = {"key": key,
                  "samples": _generate(engine, num_prompts, max_tokens, seed, trained_on,
                                       layer),
                  # writing prompts on the held-out subjects, and as many edits of the answers
                  "validation": _generate(engine, VALIDATION_PROMPTS, max_tokens, seed + 1,
                                          kept, layer)}
    if cached.get("copy_key") != copy_key:
        cached["copy_key"] = copy_key
        cached["copies"] = _generate_copies(engine, num_copy_prompts, max_tokens, seed + 2,
                                            trained_on, layer) if num_copy_prompts else []
        if samples_file is not None:
            samples_file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(cached, samples_file)
    samples, validation, copies = cached["samples"], cached["validation"], cached["copies"]
    log.info("%d samples, %d copying", len(samples), len(copies))
    generated = time.perf_counter()
    torch.manual_seed(seed)
    losses = []
    if module is None:
        vocab = draft_vocabulary(samples, draft_vocab, model.cfg.vocab_size) \
            if 0 < draft_vocab < model.cfg.vocab_size else None
        module = new_module(hf_config(model_path), model, vocab, layer)
        losses = train(module, samples, epochs, lr=lr, batch_size=batch_size, depth=depth,
                       seed=seed)
    copy_losses = train(module, copies + samples[::4], copy_epochs, lr=copy_lr,
                        batch_size=batch_size, depth=depth, seed=seed) if copies else []
    out.parent.mkdir(parents=True, exist_ok=True)
    module.save(out, model.cfg.num_layers)
    vocab = module.draft_ids
    outputs = [t for s in samples for t in s.tokens[s.num_prompt_tokens:]]
    coverage = 1.0 if vocab is None else float(torch.isin(torch.tensor(outputs), vocab)
                                               .float().mean())
    return {"samples": len(samples), "copy_samples": len(copies),
            "output_tokens": len(outputs),
            "draft_vocab": len(vocab) if vocab is not None else model.cfg.vocab_size,
            "draft_vocab_coverage": coverage, "losses": losses, "copy_losses": copy_losses,
            "hidden_layer": layer or model.cfg.num_layers,
            "held_out_subjects": kept, "held_out_agreement": agreement(module, validation),
            "generate_seconds": generated - started,
            "train_seconds": time.perf_counter() - generated}
