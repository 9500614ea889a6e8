"""A tiny random GPT-2 with a real byte-level BPE tokenizer, built in the test (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["The quick brown fox jumps over the lazy dog.",
          "A plugin registers its model family; heron loads it by architecture.",
          "Caf\u00e9, na\u00efve and emoji \U0001f680 are bytes too."] * 4
EOS = "<|endoftext|>"


def save_tokenizer(directory: Path) -> None:
    """GPT-2's kind of tokenizer, trained on a few lines: byte-level BPE, 300 tokens, id 0
    is ``<|endoftext|>`` (GPT-2's bos and eos)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS,
                                         eos_token=EOS).save_pretrained(directory)


def build_gpt2(directory: Path, seed: int = 0, **config) -> transformers.GPT2LMHeadModel:
    """Save a tiny GPT-2 whose random weights give logits of O(1-10); return it."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                    bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0,
                      0.3)
    model.eval().save_pretrained(directory)
    save_tokenizer(directory)
    return model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return path, build_gpt2(path)
