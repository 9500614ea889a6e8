"""A tiny random NLLB (M2M100ForConditionalGeneration) and a tiny NLLB tokenizer, built in
the test (no downloads), with transformers' own greedy `generate` as the oracle."""

from __future__ import annotations

import io
import random
from pathlib import Path

import torch
import transformers

LANGS = ("eng_Latn", "fra_Latn", "deu_Latn")
SYLLABLES = "ka to mi ren sa lu ber gon fi del ast quo vin xe ply dra mon tes ju hal".split()
TINY = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, tie_word_embeddings=False, dropout=0.0,
            attention_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
#: The tiny models of the nllb family's tests (the registry test's table).
MODELS = {"m2m100": (transformers.M2M100ForConditionalGeneration, transformers.M2M100Config,
                     TINY)}
EOS_BOOST = 1.5  # lm_head[eos] reads a constant feature of 2.0: EOS wins at some steps only


def corpus(num_lines: int = 300, seed: int = 0) -> list[str]:
    """Sentences of made-up words: enough distinct pieces for a 200-token BPE."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
             for _ in range(150)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "."
            for _ in range(num_lines)]


def build_tokenizer(directory: Path) -> transformers.NllbTokenizer:
    """A sentencepiece BPE (200 pieces) in NLLB's layout (fairseq ids ``<s> <pad> </s> <unk>``
    = 0-3, pieces shifted by one, ``<mask>``, then the language codes), saved with
    ``save_pretrained``.

    The vocab and merges are read with sentencepiece itself: transformers' own conversion
    of ``sentencepiece.bpe.model`` needs protobuf, which heron does not depend on."""
    import sentencepiece as spm
    from transformers.tokenization_utils_base import generate_merges

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=model,
                                   vocab_size=200, model_type="bpe", minloglevel=2,
                                   normalization_rule_name="identity")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({p: i + 1 for i, p in enumerate(pieces) if i >= 3})  # spm's 0-2 are specials
    merges = generate_merges({p: i for i, p in enumerate(pieces)})
    tok = transformers.NllbTokenizer(vocab=vocab, merges=merges, src_lang=LANGS[0],
                                     tgt_lang=LANGS[1], extra_special_tokens=list(LANGS))
    tok.save_pretrained(directory)
    return tok


def heron_model(directory: Path):
    """heron's NLLB math (the reference `NllbModel`) on the checkpoint saved in
    ``directory``, float32 on the CPU."""
    import json

    from safetensors.torch import load_file

    from heron.plugins.nllb.config import M2M100Config
    from heron.plugins.nllb.model import NllbModel
    cfg = M2M100Config.from_hf(json.loads((directory / "config.json").read_text()))
    return NllbModel(cfg, load_file(directory / "model.safetensors"), torch.device("cpu"),
                     torch.float32)


def build_nllb(directory: Path, vocab_size: int, seed: int = 0, std: float = 0.15,
               eos_boost: float = EOS_BOOST, **config):
    """Save a tiny M2M100 (2 + 2 layers, d_model 64) with weights normal(0, ``std``);
    return it in eval mode. ``config`` overrides entries of the M2M100Config.

    Random weights never pick EOS, so give the decoder's final LayerNorm a constant feature
    (weight 0, bias 2.0 on channel 0) that only lm_head's EOS row reads: EOS then wins
    where the other logits are low, and greedy translations end at different lengths
    (``eos_boost``, the EOS row's weight on that feature, sets how often)."""
    torch.manual_seed(seed)
    config = transformers.M2M100Config(**{**TINY, "vocab_size": vocab_size, **config})
    model = transformers.M2M100ForConditionalGeneration(config).eval()
    eos = config.eos_token_id
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, std)
        final = model.model.decoder.layer_norm
        final.weight[0], final.bias[0] = 0.0, 2.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = eos_boost
    model.save_pretrained(directory)
    return model


def build_translator(directory: Path, **kw) -> tuple[transformers.NllbTokenizer,
                                                      transformers.M2M100ForConditionalGeneration]:
    """The tiny tokenizer and a model over its vocabulary (``kw``: `build_nllb`'s), both
    saved in ``directory``."""
    tok = build_tokenizer(directory)
    return tok, build_nllb(directory, len(tok), **kw)
