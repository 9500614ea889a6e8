"""Incremental detokenization over the real default tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import gguf
import pytest

from heron.core.detokenizer import IncrementalDetokenizer
from heron.core.tokenizer import Tokenizer

TEXTS = [
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷.",
    "中文：我们今天去公园散步。日本語：こんにちは、世界！한국어 문장입니다.",
    "Accents: déjà vu, Ærøskøbing, naïveté, Þórr, ﬁ ligature, Ωμέγα.",
    "Mixed 🤖 code: print('héllo 世界') # ✓ done\n\n  ∑ x² ≤ ∞",
]
PROMPT = "<|im_start|>user\nSay something multilingual<|im_end|>\n<|im_start|>assistant\n"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path):
    return Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))


def _stream(tokenizer, prompt_ids, ids, chunks, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.append(ids[pos:pos + size]))
        pos += size
    assert pos == len(ids)
    return deltas, detok.flush()


def test_test_data_splits_characters(tokenizer):
    """The test below can only fail if some token is a fragment of a UTF-8 character."""
    fragments = [i for text in TEXTS for i in tokenizer.encode(text) if REPLACEMENT in tokenizer.decode([i])]
    assert len(fragments) >= 10


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_concatenate_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode(PROMPT)
    deltas, tail = _stream(tokenizer, prompt, ids, [1] * len(ids))
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert tail == ""
    assert not any(REPLACEMENT in d for d in deltas)
    assert sum(d == "" for d in deltas) > 0 or text.isascii()  # something really was held back


def test_random_chunks_and_special_tokens(tokenizer):
    rng = random.Random(0)
    ids = tokenizer.encode("<|im_start|>" + TEXTS[0] + "<|im_end|>" + TEXTS[1] + "<|endoftext|>")
    for skip in (True, False):
        for _ in range(5):
            chunks, left = [], len(ids)
            while left:
                chunks.append(min(left, rng.randint(1, 4)))
                left -= chunks[-1]
            deltas, tail = _stream(tokenizer, [], ids, chunks, skip_special_tokens=skip)
            assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
            assert not any(REPLACEMENT in d for d in deltas)
    assert "<|im_end|>" in tokenizer.decode(ids, skip_special_tokens=False)


def test_unfinished_character_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("ok 😀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tokenizer, [], True)
    emitted = "".join(detok.append([i]) for i in ids[:cut])
    assert REPLACEMENT not in emitted
    tail = detok.flush()
    assert emitted + tail == tokenizer.decode(ids[:cut])
    assert tail.endswith(REPLACEMENT)  # at the very end it shows, as a full decode does
    assert detok.append([]) == ""


def test_output_text_accumulates(tokenizer):
    ids = tokenizer.encode(TEXTS[2])
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), True)
    for i in ids:
        detok.append([i])
    detok.flush()
    assert detok.output_text == TEXTS[2]


def test_prompt_ending_mid_character_leaks_none_of_its_text(tokenizer):
    """A token-array prompt may end inside a character; the output's text starts after it
    (the bytes that complete that character are the prompt's, as in TGI and vLLM's slow
    detokenizer) and never repeats prompt text."""
    ids = tokenizer.encode("Hello there ok 😀 and more 中文 words")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    deltas, tail = _stream(tokenizer, ids[:cut], ids[cut:], [1] * (len(ids) - cut))
    assert "".join(deltas) + tail == " and more 中文 words"
