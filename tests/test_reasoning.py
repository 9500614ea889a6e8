"""Reasoning parsers on their own: where a prompt leaves its output (thinking, maybe,
thinking off) and how an output's text splits, in one piece or streamed in any pieces.
The oracle for the split is `str.partition` on the whole text."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from heron.core.config import ConfigError, load_config
from heron.core.tokenizer import Tokenizer
from heron.server.reasoning import ReasoningParser, ReasoningSplit, reasoning_parser
from tests.tiny_models import save_tokenizer

TEXTS = [
    "Let me see. 2 + 2 = 4.</think>\n\nIt is 4.",
    "<think>\nhmm, <thin is not a tag</think>The answer: </think> stays.",
    "  <think>short</think>",
    "no markers at all <think",
    "<th",
    "",
    "</think>",
    "<think>never closed, < / think",
    "\n\n<think>a</think>b<think>c</think>",
]


def oracle(text: str, opened: bool) -> tuple[str, str]:
    """An output's (reasoning, content), by the rules in `heron.server.reasoning`."""
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        text, opened = stripped[len("<think>"):], True
    if not opened:
        return "", text
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("opened", [True, False])
def test_a_streamed_split_is_the_whole_texts_split(opened):
    rng = random.Random(0)
    for text in TEXTS:
        assert ReasoningSplit(opened).feed(text, final=True) == oracle(text, opened), text
        for _ in range(50):
            split, reasoning, content = ReasoningSplit(opened), "", ""
            chunks = pieces(text, rng)
            for i, chunk in enumerate(chunks):
                r, c = split.feed(chunk, final=i == len(chunks) - 1)
                reasoning, content = reasoning + r, content + c
            assert (reasoning, content) == oracle(text, opened), (text, chunks)


def test_without_thinking_every_piece_is_content_at_once():
    split = ReasoningSplit(None)
    for piece in ["<think>", "a</th", "ink> b", " "]:
        assert split.feed(piece) == ("", piece)


def test_text_that_may_start_a_marker_waits_for_the_next_piece():
    split = ReasoningSplit(True)
    assert split.feed("2 + 2 = 4</th") == ("2 + 2 = 4", "")
    assert split.feed("ink>It is 4") == ("", "It is 4")
    split = ReasoningSplit(False)
    assert split.feed(" <thi") == ("", "")
    assert split.feed("s is no tag") == ("", " <this is no tag")
    assert split.feed(" <think>") == ("", " <think>")  # only the first thing opens it


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny byte-level BPE, with <think> and </think> added as tokens, as special
    tokens (which decoding drops) and not at all."""
    made = {}
    for kind in ("plain", "special", "absent"):
        path = tmp_path_factory.mktemp(kind)
        save_tokenizer(path)
        if kind != "absent":
            fast = PreTrainedTokenizerFast.from_pretrained(path)
            fast.add_tokens(["<think>", "</think>"], special_tokens=kind == "special")
            fast.save_pretrained(path)
        made[kind] = Tokenizer.from_hf_dir(path)
    return made


def test_where_the_prompt_leaves_the_output(tokenizers):
    tok = tokenizers["plain"]
    r1, qwen3 = ReasoningParser("deepseek_r1", tok), ReasoningParser("qwen3", tok)
    for prompt, expected in [("<s>user: hi\n<s>assistant:<think>\n", True),
                             ("<s>assistant:<think>\n\n</think>\n\n", None),
                             ("<s>assistant:<think>a</think> b\n<s>assistant:", "default"),
                             ("<s>assistant:<think> ok", "default")]:
        ids = tok.encode(prompt, add_special_tokens=False)
        assert r1.thinking(ids) is (True if expected == "default" else expected), prompt
        assert qwen3.thinking(ids) is (False if expected == "default" else expected), prompt
    gate = r1.gate(False)
    assert (gate.start_token_id, gate.end_token_id, gate.open) == (
        tok.token_to_id("<think>"), tok.token_to_id("</think>"), False)


def test_a_parser_the_model_cannot_have_is_a_config_error(tokenizers):
    with pytest.raises(ConfigError, match="lacks <think> and </think>"):
        reasoning_parser("qwen3", tokenizers["absent"])
    with pytest.raises(ConfigError, match="drops <think> and </think>"):
        reasoning_parser("qwen3", tokenizers["special"])
    with pytest.raises(ConfigError, match="needs a model with a tokenizer"):
        reasoning_parser("deepseek_r1", None)
    assert reasoning_parser("", None) is None
    with pytest.raises(ConfigError, match="reasoning_parser"):
        load_config(None, {"model.path": "x", "server.reasoning_parser": "r1"})
