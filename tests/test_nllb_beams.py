"""Beam search in the engine on the tiny NLLB: every combination of num_beams,
length_penalty, early_stopping and n, for sources of different lengths, all as concurrent
requests of one engine (so different beam settings share batches), against transformers'
``generate``: the same hypotheses in the same order, scores within 1e-4. Blocks and state
slots return to zero after beams finish, abort or are preempted."""

from __future__ import annotations

import itertools

import pytest
import torch

from heron.core import SamplingParams
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.nllb_models import build_translator, corpus

MAX_NEW_TOKENS = 20  # transformers' count: the forced target language is the first
NUM_WORDS = (2, 8, 30)
MATRIX = [(b, lp, es, n) for b, lp, es, n in itertools.product(
    (2, 4), (0.6, 1.0, 2.0), (True, False, "never"), (1, 2)) if n <= b]
PAD = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb")
    tok, hf = build_translator(directory)
    words = " ".join(corpus(8, seed=1)).split()
    sources = [tok(" ".join(words[:n])).input_ids for n in NUM_WORDS]
    fra = tok.convert_tokens_to_ids("fra_Latn")
    refs = {}
    for (b, lp, es, n), i in itertools.product(MATRIX, range(len(sources))):
        with torch.no_grad():
            out = hf.generate(torch.tensor([sources[i]]), num_beams=b, length_penalty=lp,
                              early_stopping=es, num_return_sequences=n,
                              forced_bos_token_id=fra, max_new_tokens=MAX_NEW_TOKENS,
                              output_scores=True, return_dict_in_generate=True)
        refs[b, lp, es, n, i] = [(row[2:].tolist(), score) for row, score
                                 in zip(out.sequences, out.sequences_scores.tolist())]
    return directory, sources, fra, refs


def run(engine, sources, fra, keys):
    start = engine.runner.model.cfg.decoder_start_token_id
    for b, lp, es, n, i in keys:
        params = SamplingParams(num_beams=b, length_penalty=lp, early_stopping=es, n=n,
                                max_tokens=MAX_NEW_TOKENS - 1, temperature=0.0)
        engine.add_request(repr((b, lp, es, n, i)), [start, fra], params,
                           encoder_prompt=sources[i])
    return run_to_end(engine)


def check(done, refs, keys) -> float:
    worst = 0.0
    for key in keys:
        out, want = done[repr(key)], refs[key]
        got = [(o.token_ids, o.score) for o in out.outputs]
        assert len(got) == len(want), key
        for (tokens, score), (row, ref_score) in zip(got, want):
            assert tokens + [PAD] * (len(row) - len(tokens)) == row, key
            worst = max(worst, abs(score - ref_score))
    assert worst <= 1e-4, f"max score error {worst:.2e}"
    return worst


def test_every_beam_setting_matches_generate_in_one_engine(tiny):
    directory, sources, fra, refs = tiny
    engine = make_engine(directory, **{"engine.max_num_seqs": 32})
    keys = list(refs)
    done = run(engine, sources, fra, keys)
    check(done, refs, keys)
    finishes = {o.finish_reason for out in done.values() for o in out.outputs}
    assert finishes == {"stop", "length"}
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)


def test_preempted_beams_give_the_same_hypotheses(tiny):
    directory, sources, fra, refs = tiny
    engine = make_engine(directory, **{"engine.max_num_seqs": 16, "engine.block_size": 4,
                                       "engine.num_kv_blocks": 24})
    keys = [k for k in refs if k[0] == 4][:12]
    done = run(engine, sources, fra, keys)
    assert engine.scheduler.num_preemptions > 0
    check(done, refs, keys)
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)


def test_aborted_beams_free_everything(tiny):
    directory, sources, fra, _ = tiny
    engine = make_engine(directory)
    start = engine.runner.model.cfg.decoder_start_token_id
    params = SamplingParams(num_beams=4, n=2, max_tokens=19, temperature=0.0)
    engine.add_request("a", [start, fra], params, encoder_prompt=sources[2])
    for _ in range(4):
        engine.step()
    assert len(engine._requests["a"].seqs) > 1  # forked beams hold blocks
    assert engine.num_state_slots_in_use == 1  # and share the source's cross-attention slot
    out = engine.abort("a")
    assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)


def test_beam_requests_are_checked(tiny):
    directory, sources, fra, _ = tiny
    engine = make_engine(directory, **{"engine.max_num_seqs": 4})
    with pytest.raises(ValueError, match="exceeds engine.max_num_seqs"):
        engine.add_request("x", [2, fra], SamplingParams(num_beams=8), encoder_prompt=sources[0])
    with pytest.raises(ValueError, match="n is out of range"):
        engine.add_request("x", [2, fra], SamplingParams(num_beams=2, n=3),
                           encoder_prompt=sources[0])
    with pytest.raises(ValueError, match="stop is not supported with beam search"):
        engine.add_request("x", [2, fra], SamplingParams(num_beams=2, stop=["."]),
                           encoder_prompt=sources[0])
    with pytest.raises(ValueError, match="length_penalty is out of range"):  # ** overflows
        engine.add_request("x", [2, fra], SamplingParams(num_beams=2, length_penalty=400.0),
                           encoder_prompt=sources[0])
    assert engine.num_requests == 0
