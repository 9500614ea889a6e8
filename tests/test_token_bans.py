"""vLLM's ``allowed_token_ids`` and ``bad_words``: transformers' ``SuppressTokensLogitsProcessor``
(every token but the allowed ones) and ``NoBadWordsLogitsProcessor`` (fed the output alone,
as vLLM's bad words read only the output) are the oracles, in the sampler and over HTTP."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import NoBadWordsLogitsProcessor, SuppressTokensLogitsProcessor

from heron.core.engine import Engine
from heron.core.penalties import apply_bad_words
from heron.core.sampler import NO_TOKEN, Sampler
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

VOCAB = 40


def seq_with(params: SamplingParams, output: list[int], i: int = 0) -> Sequence:
    seq = Sequence(i, f"r{i}", [1, 7, 8], params, arrival=i)
    seq.token_ids.extend(output)
    return seq


def test_allowed_tokens_are_all_that_is_sampled_and_logprobs_stay_raw():
    torch.manual_seed(0)
    raw = torch.randn(3, VOCAB) * 3
    allowed = [[5, 17, 30], None, [2]]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=a, logprobs=0) for a in allowed]
    out = Sampler((2,)).sample(raw.clone(), [seq_with(p, [], i) for i, p in enumerate(params)])
    for i, ids in enumerate(allowed):
        expected = raw[i:i + 1].clone()
        if ids is not None:
            suppress = SuppressTokensLogitsProcessor(sorted(set(range(VOCAB)) - set(ids)))
            expected = suppress(torch.tensor([[1]]), expected)
        assert out.token_ids[i] == expected.argmax().item()
        assert out.logprobs[i].logprob == pytest.approx(
            torch.log_softmax(raw[i], -1)[out.token_ids[i]].item(), abs=1e-5)
    sampled = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[4, 9, 21])
    seqs = [seq_with(sampled, [], i) for i in range(2000)]
    for seq in seqs:
        seq.generator = torch.Generator().manual_seed(seq.seq_id)
    draws = Sampler((2,)).sample(torch.zeros(len(seqs), VOCAB), seqs).token_ids
    assert set(draws) == {4, 9, 21}


@pytest.mark.parametrize("output", [[], [3], [11, 12], [5, 11, 12, 13], [12, 13, 12]])
def test_bad_words_ban_what_would_complete_them_as_transformers(output):
    words = [[6], [12, 13, 14], [12, 15], [13, 12, 16], [11, 12, 13]]
    logits = torch.randn(1, VOCAB)
    expected = NoBadWordsLogitsProcessor(words)(torch.tensor([output], dtype=torch.long),
                                               logits.clone())
    apply_bad_words(logits, [seq_with(SamplingParams(bad_words_token_ids=words), output)])
    assert torch.equal(logits.isinf(), expected.isinf()), output
    assert logits.isinf().sum() >= 1  # the one-token word, always


def test_the_prompt_does_not_start_a_bad_word():
    prompt_ends_with_12 = Sequence(0, "r", [1, 12], SamplingParams(bad_words_token_ids=[[12, 13]]),
                                   arrival=0)
    logits = torch.zeros(1, VOCAB)
    apply_bad_words(logits, [prompt_ends_with_12])
    assert not logits.isinf().any()


def test_out_of_range_and_empty_lists_and_beams_are_refused():
    for params, field in ((SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
                          (SamplingParams(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
                          (SamplingParams(bad_words_token_ids=[[]]), "bad_words_token_ids"),
                          (SamplingParams(bad_words_token_ids=[[3, -1]]), "bad_words_token_ids"),
                          (SamplingParams(num_beams=2, allowed_token_ids=[3]),
                           "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            params.validate(VOCAB)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_left_without_tokens_says_so_and_its_neighbours_sample_on(temperature):
    stuck = SamplingParams(temperature=temperature, seed=0, allowed_token_ids=[5, 6],
                           bad_words_token_ids=[[5], [6]], logprobs=1)
    free = SamplingParams(temperature=temperature, seed=0, allowed_token_ids=[5, 6],
                          bad_words_token_ids=[[5]], logprobs=1)
    seqs = [seq_with(stuck, [], 0), seq_with(free, [], 1)]
    for seq in seqs:
        seq.generator = torch.Generator().manual_seed(seq.seq_id)
    out = Sampler((2,)).sample(torch.randn(2, VOCAB), seqs)
    assert out.token_ids == [NO_TOKEN, 6] and out.no_token_rows == [0] and not out.failed_rows
    assert out.logprobs[0] is None and out.logprobs[1] is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bans")
    build_tiny("llama", path, std=0.15)
    config = server_config(path, **{"server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as s:
        yield s


def complete(server, **extra):
    return server.client().completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra}).choices[0]


def test_over_http_outputs_keep_to_the_allowed_ids_and_avoid_the_bad_words(server):
    tokenizer = server.async_engine.engine.tokenizer
    free = complete(server)
    allowed = sorted(set(free.token_ids[:3]) | {40, 41})
    kept = complete(server, allowed_token_ids=allowed)
    assert set(kept.token_ids) <= set(allowed) and kept.token_ids[:3] == free.token_ids[:3]
    word = tokenizer.decode(free.token_ids[2:4])  # two tokens the free answer writes
    clean = complete(server, bad_words=[word])
    banned = [tokenizer.encode(t, add_special_tokens=False) for t in (word, " " + word.lstrip())]
    assert free.token_ids[2:4] in banned  # the free answer writes the word
    for ids in banned:
        assert not any(clean.token_ids[j:j + len(ids)] == ids
                       for j in range(len(clean.token_ids))), (word, ids)
    assert clean.token_ids[:3] == free.token_ids[:3]  # the word's first token stays free


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [999999]}, None),
    ({"bad_words": [""]}, "bad_words"),
])
def test_bad_ban_fields_are_400s(server, extra, param):
    status, _, raw = server.http("POST", "/v1/completions",
                                 {"model": "tiny", "prompt": "hi", **extra})
    assert status == 400, raw


def test_restrictions_that_leave_no_token_are_a_400_and_free_what_they_held(server):
    tokenizer = server.async_engine.engine.tokenizer
    token = next(t for t in complete(server).token_ids
                 if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8,
            "allowed_token_ids": [token], "bad_words": [tokenizer.decode([token])]}
    status, _, raw = server.http("POST", "/v1/completions", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "no_token_left", error
    assert "allowed_token_ids" in error["message"]
    status, _, raw = server.http("POST", "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert status == 200 and events[-1]["error"]["code"] == "no_token_left", events
    engine = server.async_engine.engine
    assert engine.num_requests == 0 and engine.num_blocks_in_use == 0
