"""Beam search bookkeeping against transformers' ``generate(num_beams=...)``: the tiny NLLB
driven through `BeamSearch` (one KV cache per beam, copied on fork, as the engine will)
must return transformers' sequences token for token and its ``sequences_scores``."""

from __future__ import annotations

import itertools

import pytest
import torch

from heron.core.beam_search import BeamSearch, step_searches
from heron.plugins.nllb.model import NllbModel, SequenceKV
from tests.nllb_models import build_translator, corpus, heron_model

pytest.importorskip("sentencepiece")

MAX_NEW_TOKENS = 20
TOL = 1e-4  # sequences_scores, float32, abs
NUM_WORDS = (2, 8, 30)  # source lengths; 2 and 30 are where early_stopping False != "never"
MATRIX = [(b, lp, es, n) for b, lp, es, n in itertools.product(
    (2, 4), (0.6, 1.0, 2.0), (True, False, "never"), (1, 2)) if n <= b]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb")
    tok, hf = build_translator(directory)
    ours = heron_model(directory)
    words = " ".join(corpus(8, seed=1)).split()
    sources = [torch.tensor(tok(" ".join(words[:n])).input_ids) for n in NUM_WORDS]
    return hf, ours, sources, tok.convert_tokens_to_ids("fra_Latn")


@pytest.fixture(scope="module")
def reference(tiny):
    """``reference(source_index, **generate_kwargs)`` -> transformers' ``[(row, score)]``,
    ``row`` the new tokens padded (pad id 1) to the longest returned; memoized, as the
    discrimination test reuses the matrix."""
    hf, _, sources, fra = tiny
    memo = {}

    def run(i: int, **kwargs) -> list[tuple[list[int], float]]:
        key = repr((i, sorted(kwargs.items())))
        if key not in memo:
            kwargs = {"forced_bos_token_id": fra, "max_new_tokens": MAX_NEW_TOKENS, **kwargs}
            with torch.no_grad():
                out = hf.generate(sources[i][None], output_scores=True,
                                  return_dict_in_generate=True, **kwargs)
            assert all(row[0] == hf.config.decoder_start_token_id for row in out.sequences)
            memo[key] = [(row[1:].tolist(), score)
                         for row, score in zip(out.sequences, out.sequences_scores.tolist())]
        return memo[key]
    return run


def _fork(kv: SequenceKV) -> SequenceKV:
    return SequenceKV([(k.clone(), v.clone()) for k, v in kv.layers], kv.length)


def _beam_translate(model: NllbModel, src: torch.Tensor, search: BeamSearch,
                    max_new_tokens: int = MAX_NEW_TOKENS) -> list[tuple[list[int], float]]:
    """What the engine will do: decode the start token, then per step fork each chosen
    parent's KV and decode the chosen token on it."""
    cfg = model.cfg
    cross = model.cross_kv(model.encode(src))
    kv = SequenceKV.allocate(cfg, max_new_tokens + 1, src.device, model.dtype)
    logits = model.decode(torch.tensor([cfg.decoder_start_token_id]), torch.arange(1), kv, cross)
    beams = [kv]
    while chosen := search.step(logits):
        assert len(chosen) == search.num_beams
        beams = [_fork(beams[parent]) for parent, _ in chosen]
        logits = torch.cat([model.decode(torch.tensor([token]), torch.tensor([kv.length]), kv,
                                         cross) for kv, (_, token) in zip(beams, chosen)])
    assert search.done
    return search.results()


def _assert_same(got, want, pad: int = 1) -> float:
    """Same hypotheses in the same order (``got`` padded like transformers' rows), scores
    within TOL; returns the largest score error."""
    assert len(got) == len(want)
    for (tokens, _), (row, _) in zip(got, want):
        assert len(tokens) <= len(row) and tokens + [pad] * (len(row) - len(tokens)) == row
    error = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert error < TOL, (got, want)
    return error


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping, num_return", MATRIX)
def test_matches_generate(tiny, reference, num_beams, length_penalty, early_stopping,
                          num_return):
    _, ours, sources, fra = tiny
    for i, src in enumerate(sources):
        search = BeamSearch(num_beams, MAX_NEW_TOKENS, ours.cfg.eos_token_ids,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            num_return=num_return, forced_first_token=fra)
        want = reference(i, num_beams=num_beams, length_penalty=length_penalty,
                         early_stopping=early_stopping, num_return_sequences=num_return)
        assert len(want) == num_return
        _assert_same(_beam_translate(ours, src, search), want)


def test_matrix_discriminates(reference):
    """Every knob changes some of transformers' answers (which the parity test holds ours
    to), so the matrix would catch a knob being ignored or mishandled."""
    def outputs(b, lp, es, n):
        return [[row for row, _ in reference(i, num_beams=b, length_penalty=lp,
                                             early_stopping=es, num_return_sequences=n)]
                for i in range(len(NUM_WORDS))]

    def differs(knob: str, a, b) -> bool:
        """Does ``knob`` = ``a`` answer differently from ``knob`` = ``b``, all else equal,
        for some entry of the matrix?"""
        for setting in MATRIX:
            knobs = dict(zip(("b", "lp", "es", "n"), setting))
            other = {**knobs, knob: b}
            if knobs[knob] == a and tuple(other.values()) in MATRIX \
                    and outputs(**knobs) != outputs(**other):
                return True
        return False
    assert differs("lp", 0.6, 1.0) and differs("lp", 1.0, 2.0)
    assert differs("es", True, False) and differs("es", False, "never")
    assert differs("b", 2, 4)
    # some returned hypotheses are cut by max_new_tokens, some end in EOS (id 2) earlier
    ends = {row.index(2) + 1 if 2 in row else len(row)
            for s in MATRIX for out in outputs(*s) for row in out}
    assert MAX_NEW_TOKENS in ends and min(ends) < MAX_NEW_TOKENS, ends


def test_min_new_tokens(tiny, reference):
    _, ours, sources, fra = tiny
    changed = False
    for i, src in enumerate(sources):
        search = BeamSearch(4, MAX_NEW_TOKENS, ours.cfg.eos_token_ids, num_return=2,
                            min_new_tokens=5, forced_first_token=fra)
        want = reference(i, num_beams=4, num_return_sequences=2, min_new_tokens=5)
        got = _beam_translate(ours, src, search)
        _assert_same(got, want)
        # EOS is banned while fewer than 5 new tokens exist (the language code counts)
        assert all(len(tokens) >= 6 for tokens, _ in got)
        changed |= want != reference(i, num_beams=4, num_return_sequences=2)
    assert changed, "min_new_tokens=5 changes no answer"


@pytest.mark.parametrize("min_new_tokens", [0, 1])
def test_eos_at_the_first_step(tiny, reference, min_new_tokens):
    """Without a forced language code EOS is the best first token: with no length penalty
    the one-token hypothesis ``[EOS]`` wins, unless min_new_tokens bans it."""
    _, ours, sources, _ = tiny
    eos = ours.cfg.eos_token_ids
    search = BeamSearch(2, 6, eos, length_penalty=0.0, early_stopping=True, num_return=2,
                        min_new_tokens=min_new_tokens)
    got = _beam_translate(ours, sources[1], search, max_new_tokens=6)
    _assert_same(got, reference(1, num_beams=2, length_penalty=0.0, early_stopping=True,
                                num_return_sequences=2, max_new_tokens=6,
                                min_new_tokens=min_new_tokens, forced_bos_token_id=None))
    assert (got[0][0] == list(eos)) == (min_new_tokens == 0), got


@pytest.mark.parametrize("num_beams", [2, 4])
def test_several_eos_ids(tiny, reference, num_beams):
    """With E EOS ids the step keeps (1 + E) * num_beams candidates."""
    _, ours, sources, fra = tiny
    eos = (2, 189)  # 189 is a frequent piece of the tiny model
    for i, src in enumerate(sources):
        search = BeamSearch(num_beams, MAX_NEW_TOKENS, eos, num_return=2,
                            forced_first_token=fra)
        assert search.num_candidates == 3 * num_beams
        got = _beam_translate(ours, src, search)
        _assert_same(got, reference(i, num_beams=num_beams, num_return_sequences=2,
                                    eos_token_id=list(eos)))
        assert any(tokens[-1] == 189 for tokens, _ in got)


def test_max_new_tokens_one_returns_the_placeholder_slot(tiny, reference):
    """Only the forced token is possible, so only one real hypothesis exists; transformers
    still returns num_return rows, the others from never-filled slots (score -1e9)."""
    _, ours, sources, fra = tiny
    search = BeamSearch(2, 1, ours.cfg.eos_token_ids, num_return=2, forced_first_token=fra)
    got = _beam_translate(ours, sources[0], search, max_new_tokens=1)
    want = reference(0, num_beams=2, num_return_sequences=2, max_new_tokens=1)
    assert got[0] == ([fra], 0.0) and got[1][1] == pytest.approx(-1e9)
    _assert_same(got, want)


# Synthetic logits: the edge cases, checked against the definitions rather than transformers.

VOCAB, EOS = 8, 7


def _logits(prefix: list[int], eos_bias: float = 0.0) -> torch.Tensor:
    """Deterministic pseudo-random logits for a prefix."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash(tuple(prefix)) % 2**31))
    row[EOS] += eos_bias
    return row


def _drive(search: BeamSearch, logits_of) -> int:
    """Run ``search`` to the end over ``logits_of(prefix)``; return the number of steps."""
    beams, num_steps = [[]], 0
    while chosen := search.step(torch.stack([logits_of(b) for b in beams])):
        num_steps += 1
        assert len(chosen) == search.num_beams
        assert all(EOS not in beams[p] + [t] for p, t in chosen)  # no finished beam runs on
        beams = [beams[p] + [t] for p, t in chosen]
    return num_steps + 1


def _score(tokens: list[int], logits_of, length_penalty: float) -> float:
    logprobs = [torch.log_softmax(logits_of(tokens[:i]), -1)[t] for i, t in enumerate(tokens)]
    return float(sum(logprobs)) / len(tokens) ** length_penalty


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_max_new_tokens_reached(length_penalty):
    logits_of = lambda p: _logits(p, eos_bias=-50.0)  # noqa: E731: EOS never wins
    search = BeamSearch(3, 4, (EOS,), length_penalty=length_penalty, num_return=3)
    assert _drive(search, logits_of) == 4
    results = search.results()
    assert [len(t) for t, _ in results] == [4, 4, 4] and len({tuple(t) for t, _ in results}) == 3
    for tokens, score in results:
        assert score == pytest.approx(_score(tokens, logits_of, length_penalty), abs=1e-5)
    assert [s for _, s in results] == sorted((s for _, s in results), reverse=True)


def test_only_one_possible_token():
    """One real hypothesis: the other beams are beam 0's -1e9 copies from the first step,
    and the best of them takes the second finished slot, as in transformers."""
    only_3 = torch.full((VOCAB,), -torch.inf)
    only_3[3] = 0.0
    search = BeamSearch(2, 3, (EOS,), length_penalty=2.0, num_return=2)
    assert _drive(search, lambda p: only_3) == 3
    assert search.results() == [([3, 3, 3], 0.0), ([3, 3, 3], pytest.approx(-1e9 / 3**2))]


def test_all_beams_finish():
    """At the second step EOS is far the best token of both beams: both finished slots
    fill. True and False stop there (the running beams are 30 nats behind); "never" judges
    the running beams at max_new_tokens (score / 100), where they still look better, and
    runs on until their deficit grows too large. Nothing later beats the first two."""
    logits_of = lambda p: _logits(p, eos_bias=-50.0 if not p else 30.0)  # noqa: E731
    num_steps, results = {}, []
    for early_stopping in (True, False, "never"):
        search = BeamSearch(2, 100, (EOS,), early_stopping=early_stopping, num_return=2)
        num_steps[early_stopping] = _drive(search, logits_of)
        results.append(search.results())
    assert num_steps[True] == num_steps[False] == 2 and 2 < num_steps["never"] < 100
    assert all(r == results[0] for r in results)
    assert [len(t) for t, _ in results[0]] == [2, 2] and all(t[-1] == EOS for t, _ in results[0])
    for tokens, score in results[0]:
        assert score == pytest.approx(_score(tokens, logits_of, 1.0), abs=1e-5)


def test_first_step_takes_the_prompt_row_and_forks_it():
    search = BeamSearch(3, 5, (EOS,), forced_first_token=4)
    with pytest.raises(ValueError, match=r"\[1, vocab\]"):
        search.step(torch.zeros(3, VOCAB))
    assert search.step(_logits([])[None]) == [(0, 4)] * 3  # forced: copies at -1e9 follow
    with pytest.raises(ValueError, match=r"\[3, vocab\]"):
        search.step(torch.zeros(1, VOCAB))
    chosen = search.step(torch.stack([_logits([4])] * 3))
    assert [p for p, _ in chosen] == [0, 0, 0]  # beams 1, 2 are still -1e9 copies
    assert len({t for _, t in chosen}) == 3


def test_misuse_is_refused():
    for kwargs in ({"num_beams": 1}, {"num_return": 3}, {"max_new_tokens": 0},
                   {"early_stopping": "always"}, {"min_new_tokens": -1}):
        with pytest.raises(ValueError):
            BeamSearch(**{"num_beams": 2, "max_new_tokens": 4, "eos_token_ids": (EOS,), **kwargs})
    search = BeamSearch(2, 1, (EOS,))
    with pytest.raises(RuntimeError):
        search.results()
    assert search.step(_logits([])[None]) == [] and search.done
    with pytest.raises(RuntimeError):
        search.step(_logits([])[None])
    assert [len(t) for t, _ in search.results()] == [1]


def test_searches_stepped_together_step_as_alone():
    """`step_searches` batches the tensor work of searches with different beam counts,
    penalties, stopping rules, EOS sets, forced and minimum tokens, whose logits rows
    arrive in any order: each must choose exactly what it chooses stepped alone. The
    logits are rounded to halves so that ties occur and must break alike."""
    def logits_of(prefix):
        return (_logits(prefix, eos_bias=1.5) * 2).round() / 2

    settings = [dict(num_beams=b, max_new_tokens=m, eos_token_ids=eos, length_penalty=lp,
                     early_stopping=es, num_return=min(2, b), min_new_tokens=mn,
                     forced_first_token=ff)
                for b, m, eos, lp, es, mn, ff in [
                    (2, 6, (EOS,), 1.0, False, 0, None), (4, 9, (EOS,), 0.6, True, 2, 4),
                    (3, 7, (EOS, 6), 2.0, "never", 0, None), (4, 5, (), 1.0, False, 0, 3),
                    (2, 8, (EOS,), 0.0, "never", 3, 5), (4, 9, (EOS,), 2.0, False, 0, None)]]
    alone = []
    for kwargs in settings:
        search, beams, trace = BeamSearch(**kwargs), [[]], []
        while chosen := search.step(torch.stack([logits_of(b) for b in beams])):
            trace.append(chosen)
            beams = [beams[p] + [t] for p, t in chosen]
        alone.append((trace, search.results()))

    searches = [BeamSearch(**kwargs) for kwargs in settings]
    beams = [[[]] for _ in searches]
    traces = [[] for _ in searches]
    order = torch.Generator().manual_seed(0)
    while live := [i for i, s in enumerate(searches) if not s.done]:
        rows = [(i, b) for i in live for b in beams[i]]
        perm = torch.randperm(len(rows), generator=order).tolist()  # rows in any order
        logits = torch.stack([logits_of(rows[j][1]) for j in perm])
        where = {j: r for r, j in enumerate(perm)}
        offsets = [sum(len(beams[k]) for k in live[:n]) for n in range(len(live))]
        steps = step_searches([searches[i] for i in live], logits,
                              [[where[o + b] for b in range(len(beams[i]))]
                               for i, o in zip(live, offsets)])
        for i, chosen in zip(live, steps):
            if chosen:
                traces[i].append(chosen)
                beams[i] = [beams[i][p] + [t] for p, t in chosen]
    assert len({len(t) for t, _ in alone}) > 1  # they end at different steps
    assert [(t, s.results()) for t, s in zip(traces, searches)] == alone


def test_a_failing_step_leaves_every_search_as_it_was():
    """A step of several searches that fails (here the second beam count's group, after the
    first group's tensors are worked out) changes none of them: the engine then steps each
    alone to fail only the faulty one, which must not step the others twice."""
    good = BeamSearch(num_beams=2, max_new_tokens=6, eos_token_ids=(EOS,))
    bad = BeamSearch(num_beams=3, max_new_tokens=6, eos_token_ids=(EOS,))
    logits = torch.stack([_logits([]), _logits([])])
    step_searches([good, bad], logits, [[0], [1]])
    before = (list(good._running), good._running_scores.clone(), good.num_new_tokens)
    bad._running_scores = torch.zeros(7)  # no longer its beams': its group's sum raises
    logits = torch.stack([_logits([1])] * 5)
    with pytest.raises(RuntimeError):
        step_searches([good, bad], logits, [[0, 1], [2, 3, 4]])
    assert (good._running, good.num_new_tokens) == (before[0], before[2])
    assert torch.equal(good._running_scores, before[1]) and not good.done
    assert step_searches([good], logits, [[0, 1]])[0]  # and it steps on from there
    assert good.num_new_tokens == 2
