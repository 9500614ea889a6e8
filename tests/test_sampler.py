"""Sampler tests: distributions, filters, seeds, penalties, min_tokens, logprobs, failures.

Every expected value is computed independently of heron's code: plain-Python loops in
float64, ``torch.log_softmax`` on the raw logits, and transformers'
``RepetitionPenaltyLogitsProcessor`` as the repetition-penalty oracle.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import heron.core.penalties as penalties_module
import heron.core.sampler as sampler_module
from heron.core.logprobs import prompt_logprobs
from heron.core.penalties import apply_penalties
from heron.core.sampler import FAILED, Sampler, SamplerOutput
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence
from tests.kernel_utils import vector_widths

EOS = (2, 9)
NUM_DRAWS = 20_000
MAX_FREQ_ERROR = 0.02
HAS_CUDA = torch.cuda.is_available()

# A known 8-token distribution, placed on shuffled ids so "most likely" is not "lowest id".
_PROBS_BY_RANK = [0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]
_ID_OF_RANK = [5, 2, 7, 0, 3, 6, 1, 4]
BASE_PROBS = [0.0] * 8
for _rank, _token in enumerate(_ID_OF_RANK):
    BASE_PROBS[_token] = _PROBS_BY_RANK[_rank]
BASE_LOGITS = [math.log(p) + 1.5 for p in BASE_PROBS]  # the shift must not matter


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")])])
def device(request) -> str:
    """Each sampler test runs on the CPU, and again on CUDA where there is a GPU."""
    return request.param


def make_seq(params: SamplingParams, prompt: list[int] | None = None,
             output: list[int] | None = None, seq_id: int = 0,
             device: str = "cpu") -> Sequence:
    """A real Sequence, with a seeded generator when the params carry a seed (as the engine)."""
    seq = Sequence(seq_id, f"req-{seq_id}", prompt if prompt is not None else [1, 3, 4],
                   params, arrival=seq_id)
    seq.token_ids.extend(output or [])
    if params.seed is not None:
        seq.generator = torch.Generator(device=device).manual_seed(params.seed)
    return seq


def softmax64(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    return [w / total for w in weights]


def reference_allowed(probs: list[float], top_k: int, top_p: float,
                      min_p: float) -> dict[int, float]:
    """Tokens surviving top-k, then top-p, then min-p, with their renormalised probabilities."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t] for t in kept)
    nucleus, cumulative = [], 0.0
    for token in kept:
        nucleus.append(token)
        cumulative += probs[token] / mass
        if cumulative >= top_p:
            break
    best = max(probs[t] for t in nucleus)
    final = [t for t in nucleus if probs[t] >= min_p * best]
    total = sum(probs[t] for t in final)
    return {t: probs[t] / total for t in final}


def draw_frequencies(device: str, params: SamplingParams, other: SamplingParams | None = None
                     ) -> tuple[list[float], list[float] | None]:
    """Sample BASE_LOGITS NUM_DRAWS times under ``params`` (one row each, one batch).

    With ``other``, every second row uses it instead, so the batch mixes settings and the
    sampler's row-subset paths run; both groups' frequencies come back.
    """
    torch.manual_seed(0)
    groups = [params] if other is None else [params, other]
    seqs = [make_seq(groups[i % len(groups)], seq_id=i, device=device)
            for i in range(NUM_DRAWS * len(groups))]
    logits = torch.tensor([BASE_LOGITS], dtype=torch.float32, device=device).repeat(len(seqs), 1)
    tokens = Sampler(EOS).sample(logits, seqs).token_ids
    freqs = []
    for g in range(len(groups)):
        counts = Counter(tokens[g::len(groups)])
        freqs.append([counts[t] / NUM_DRAWS for t in range(len(BASE_LOGITS))])
    return freqs[0], (freqs[1] if other is not None else None)


def assert_matches(freqs: list[float], expected: dict[int, float]) -> None:
    outside = {t: f for t, f in enumerate(freqs) if f > 0 and t not in expected}
    assert not outside, f"sampled tokens outside the allowed set: {outside}"
    errors = [abs(freqs[t] - expected.get(t, 0.0)) for t in range(len(freqs))]
    assert max(errors) < MAX_FREQ_ERROR, f"freqs {freqs} vs expected {expected}"


# --------------------------------------------------------------------------- greedy


# 1e-39 would overflow logits / temperature to inf (and softmax to NaN) if it were sampled.
@pytest.mark.parametrize("temperature", [0.0, 1e-7, 1e-39])
def test_greedy_rows_take_argmax(temperature, device):
    torch.manual_seed(1)
    logits = torch.randn(16, 100, device=device) * 3
    seqs = [make_seq(SamplingParams(temperature=temperature), seq_id=i) for i in range(16)]
    out = Sampler(EOS).sample(logits.clone(), seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.failed_rows == [] and out.logprobs is None


def test_greedy_and_sampled_rows_mix(device):
    torch.manual_seed(2)
    logits = torch.randn(6, 40, device=device)
    logits[1, 7] = 50.0  # a sampled row this peaked must pick token 7
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    seqs = [make_seq(p, seq_id=i) for i, p in enumerate(params)]
    out = Sampler(EOS).sample(logits.clone(), seqs)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()
    assert out.token_ids[1] == 7


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_temperature_distribution(temperature, device):
    freqs, _ = draw_frequencies(device, SamplingParams(temperature=temperature))
    expected = dict(enumerate(softmax64(BASE_LOGITS, temperature)))
    assert_matches(freqs, expected)


def expected_distribution(params: SamplingParams) -> dict[int, float]:
    probs = softmax64(BASE_LOGITS, params.temperature)
    return reference_allowed(probs, params.top_k, params.top_p, params.min_p)


FILTER_CASES = {
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.3),
    "top_k_above_vocab": dict(top_k=50),
    "all_with_temperature": dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.2),
}
# Pairs of settings sharing one batch (rows alternate), so per-row values must not leak.
MIXED_CASES = {
    "default_with_top_k": (dict(top_k=3), dict()),
    "default_with_top_p": (dict(top_p=0.6), dict()),
    "default_with_all": (dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.2), dict()),
    "two_top_k": (dict(top_k=2), dict(top_k=5)),
    "top_k_and_top_p": (dict(top_k=3), dict(top_p=0.7, temperature=1.3)),
    "two_min_p": (dict(min_p=0.45), dict(min_p=0.1, temperature=0.7)),
}


@pytest.mark.parametrize("case", FILTER_CASES.values(), ids=FILTER_CASES.keys())
def test_filters_stay_in_allowed_set_and_match_renormalised(case, device):
    params = SamplingParams(**case)
    freqs, _ = draw_frequencies(device, params)
    expected = expected_distribution(params)
    if case.get("top_k", 0) < len(BASE_LOGITS):
        assert len(expected) < len(BASE_LOGITS), "case must actually filter something"
    assert_matches(freqs, expected)


@pytest.mark.parametrize("case", MIXED_CASES.values(), ids=MIXED_CASES.keys())
def test_mixed_filters_in_one_batch(case, device):
    first, second = SamplingParams(**case[0]), SamplingParams(**case[1])
    first_freqs, second_freqs = draw_frequencies(device, first, other=second)
    assert_matches(first_freqs, expected_distribution(first))
    assert_matches(second_freqs, expected_distribution(second))


def test_top_p_of_one_cuts_nothing_despite_rounding():
    # Float32 rounds this row's top probability to 1.0, so the running mass reaches 1.0
    # before the tail; a row with top_p == 1 sharing a sort with a top_p < 1 row must
    # still keep its tail.
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0]] * 2)
    sampler_module._apply_top_k_top_p(logits, top_k=[4, 4], top_p=[1.0, 0.5])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).tolist() == [True, False, False, False]


@pytest.mark.parametrize("extreme", ["low", "high"])
def test_extreme_noise_never_picks_a_masked_token(monkeypatch, device, extreme):
    # Force the random draws to their edges: uniform 0 (or just below 1), and exponential
    # 0, which torch can return on some backends (pytorch#22557), or very large.
    uniform = 0.0 if extreme == "low" else 1.0 - 2.0 ** -24
    exponential = 0.0 if extreme == "low" else 50.0
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(uniform))
    monkeypatch.setattr(torch.Tensor, "exponential_",
                        lambda self, *a, **k: self.fill_(exponential))
    inf = float("-inf")
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.5], [0.0, 2.0, 1.0, 0.5],
                           [inf, 1.0, 2.0, inf], [inf, 1.0, 2.0, inf]], device=device)
    params = [SamplingParams(top_k=2), SamplingParams(min_p=0.5, seed=1),
              SamplingParams(), SamplingParams(seed=2)]
    allowed = [{1, 2}, {1}, {1, 2}, {1, 2}]
    seqs = [make_seq(p, seq_id=i, device=device) for i, p in enumerate(params)]
    tokens = Sampler(EOS).sample(logits, seqs).token_ids
    assert all(t in ok for t, ok in zip(tokens, allowed)), tokens


@pytest.mark.parametrize("top_p", [1.0, 0.99])  # top-k alone, and top-k in the sort path
def test_top_k_keeps_ties_at_the_boundary(device, top_p):
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, -1.0]], device=device).repeat(4000, 1)
    params = SamplingParams(top_k=2, top_p=top_p)
    seqs = [make_seq(params, seq_id=i) for i in range(4000)]
    torch.manual_seed(3)
    tokens = set(Sampler(EOS).sample(logits, seqs).token_ids)
    assert tokens == {0, 1, 2}


# --------------------------------------------------------------------------- seeds

OTHER_ROWS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, logprobs=2),
    SamplingParams(temperature=1.3, min_p=0.1, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, seed=99),
    SamplingParams(temperature=0.7, top_p=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=7, top_k=4),
]


def generate_seeded(device: str, target: SamplingParams, position: int, batch_size: int,
                    global_seed: int, num_steps: int = 8) -> list[int]:
    """The target row's tokens over ``num_steps`` steps, placed at ``position`` in a batch."""
    vocab_size = 64
    base = torch.randn(vocab_size, generator=torch.Generator().manual_seed(42)).to(device)
    torch.manual_seed(global_seed)
    seqs = [make_seq(OTHER_ROWS[i % len(OTHER_ROWS)], seq_id=i, device=device)
            for i in range(batch_size - 1)]
    target_seq = make_seq(target, seq_id=1000, device=device)
    seqs.insert(position, target_seq)
    sampler = Sampler(EOS)
    for _ in range(num_steps):
        logits = base.repeat(batch_size, 1) + torch.randn(batch_size, vocab_size, device=device)
        logits[position] = base  # the target's logits depend only on the target
        out = sampler.sample(logits, seqs)
        for seq, token in zip(seqs, out.token_ids):
            seq.token_ids.append(token)
    return target_seq.output_token_ids


SEEDED_TARGETS = {
    "plain": SamplingParams(temperature=1.0, seed=1234),
    "filtered": SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02,
                               presence_penalty=0.4, seed=1234, logprobs=1),
}


@pytest.mark.parametrize("target", SEEDED_TARGETS.values(), ids=SEEDED_TARGETS.keys())
def test_same_seed_same_tokens_regardless_of_batch(target, device):
    layouts = [(0, 1, 0), (0, 4, 1), (3, 5, 2), (7, 8, 3), (2, 12, 4)]
    runs = [generate_seeded(device, target, pos, size, seed) for pos, size, seed in layouts]
    assert all(run == runs[0] for run in runs), runs
    assert len(set(runs[0])) > 1, "the target must actually sample"


def test_different_seeds_differ(device):
    a = generate_seeded(device, SamplingParams(seed=1234), 1, 4, 0)
    b = generate_seeded(device, SamplingParams(seed=4321), 1, 4, 0)
    assert a != b


# --------------------------------------------------------------------------- penalties


def reference_penalized(row: list[float], prompt: list[int], output: list[int],
                        params: SamplingParams) -> list[float]:
    out = list(row)
    for token in set(prompt) | set(output):
        p = params.repetition_penalty
        out[token] = out[token] / p if out[token] > 0 else out[token] * p
    for token, count in Counter(output).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


PENALTY_ROWS = [
    (SamplingParams(repetition_penalty=1.5), [1, 4, 4, 7], [8, 1]),
    (SamplingParams(), [1, 2, 3], [3, 3]),  # neutral: must stay untouched
    (SamplingParams(frequency_penalty=0.7), [5, 6], [6, 6, 9, 10, 6]),
    (SamplingParams(presence_penalty=-1.2), [5], [11, 11, 0]),
    (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.1),
     [0, 2, 2, 13], [13, 14, 14, 2]),
    (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.3), [7, 8], []),
]


def test_penalties_match_loop_reference(device):
    torch.manual_seed(5)
    logits = torch.randn(len(PENALTY_ROWS), 16) * 2
    seqs = [make_seq(p, prompt, output, i) for i, (p, prompt, output) in enumerate(PENALTY_ROWS)]
    penalized = logits.to(device, copy=True)
    apply_penalties(penalized, seqs)
    penalized = penalized.cpu()
    for i, (params, prompt, output) in enumerate(PENALTY_ROWS):
        expected = reference_penalized(logits[i].tolist(), prompt, output, params)
        assert penalized[i].tolist() == pytest.approx(expected, abs=1e-5), i
    assert torch.equal(penalized[1], logits[1])


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(penalty, device):
    torch.manual_seed(6)
    vocab_size = 50
    histories = [([3, 4, 4, 10], [11, 3]), ([0, 49], [25, 25, 26]), ([7], [])]
    logits = torch.randn(len(histories), vocab_size) * 3
    seqs = [make_seq(SamplingParams(repetition_penalty=penalty), p, o, i)
            for i, (p, o) in enumerate(histories)]
    ours = logits.to(device, copy=True)
    apply_penalties(ours, seqs)
    ours = ours.cpu()
    oracle = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for i, (prompt, output) in enumerate(histories):
        expected = oracle(torch.tensor([prompt + output]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], expected)


def test_penalties_ignore_ids_beyond_the_logits(device):
    logits = torch.randn(1, 8)
    seq = make_seq(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), [1, 20], [30])
    penalized = logits.to(device, copy=True)
    apply_penalties(penalized, [seq])
    penalized = penalized.cpu()
    expected = reference_penalized(logits[0].tolist(), [1], [], seq.params)
    assert penalized[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_penalties_change_the_greedy_choice(device):
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]], device=device)
    seq = make_seq(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], [1])
    assert Sampler(EOS).sample(logits, [seq]).token_ids == [2]


def test_fast_paths_skip_penalty_and_sort_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("fast path should not reach here")

    monkeypatch.setattr(penalties_module, "_penalize", forbidden)
    monkeypatch.setattr(sampler_module, "_apply_top_k_top_p", forbidden)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(min_p=0.1),
              SamplingParams(temperature=0.5, seed=3), SamplingParams(top_k=100)]
    seqs = [make_seq(p, output=[1, 1], seq_id=i) for i, p in enumerate(params)]
    out = Sampler(EOS).sample(torch.randn(len(seqs), 32), seqs)
    assert len(out.token_ids) == len(seqs) and out.failed_rows == []

    # ...and the guarded work does run once a row needs it (the patches are live).
    with pytest.raises(AssertionError, match="fast path"):
        Sampler(EOS).sample(torch.randn(1, 32), [make_seq(SamplingParams(top_p=0.5))])
    with pytest.raises(AssertionError, match="fast path"):
        Sampler(EOS).sample(torch.randn(1, 32),
                            [make_seq(SamplingParams(presence_penalty=0.5))])


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached(device):
    # Preference order: EOS 2, stop token 5, EOS 9, then token 0.
    logits_row = torch.tensor([4.0, -1, 9, -1, -1, 8, -1, -1, -1, 7], device=device)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 100])
    seq = make_seq(params)
    free = make_seq(SamplingParams(temperature=0.0), seq_id=1)  # no min_tokens: takes EOS
    sampler = Sampler(EOS)
    picked = []
    for _ in range(4):
        out = sampler.sample(logits_row.repeat(2, 1), [seq, free])
        assert out.token_ids[1] == 2
        picked.append(out.token_ids[0])
        seq.token_ids.append(out.token_ids[0])
    assert picked == [0, 0, 0, 2]


def test_min_tokens_with_ignore_eos_still_masks_stop_ids(device):
    logits_row = torch.tensor([[4.0, -1, 9, -1, -1, 10, -1, -1, -1, 7]], device=device)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert Sampler(EOS).sample(logits_row, [make_seq(params)]).token_ids == [2]


def test_min_tokens_holds_when_sampling(device):
    torch.manual_seed(8)
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 3.0]],
                          device=device).repeat(3000, 1)
    params = SamplingParams(min_tokens=1, stop_token_ids=[5])
    seqs = [make_seq(params, seq_id=i) for i in range(3000)]
    tokens = set(Sampler(EOS).sample(logits, seqs).token_ids)
    assert tokens == {0, 1, 3, 4, 6, 7, 8}


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_correct_ranks_and_top(device):
    torch.manual_seed(9)
    vocab_size = 50
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.8),
        SamplingParams(logprobs=5, top_k=4, frequency_penalty=1.5, seed=11),
        SamplingParams(logprobs=2, temperature=0.0, presence_penalty=2.0),
        SamplingParams(logprobs=7, min_p=0.2),
    ]
    seqs = [make_seq(p, [1, 2, 3], [4, 4, 5], i, device) for i, p in enumerate(params)]
    logits = torch.randn(len(seqs), vocab_size) * 2
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler(EOS).sample(logits.to(device), seqs)
    assert isinstance(out, SamplerOutput) and out.logprobs[0] is None
    for i, p in enumerate(params[1:], start=1):
        entry = out.logprobs[i]
        token = out.token_ids[i]
        row = raw[i].tolist()
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token], abs=1e-6)
        assert entry.rank == 1 + sum(1 for x in row if x > row[token])
        expected_top = sorted(range(vocab_size), key=lambda t: -row[t])[: p.logprobs]
        assert [t for t, _ in entry.top] == expected_top
        assert [lp for _, lp in entry.top] == pytest.approx([row[t] for t in expected_top],
                                                            abs=1e-6)


def test_prompt_logprobs(device):
    torch.manual_seed(10)
    logits = torch.randn(5, 20) * 2
    targets = [3, 0, 19, 7, 7]
    raw = torch.log_softmax(logits, dim=-1)
    result = prompt_logprobs(logits.to(device), torch.tensor(targets, device=device), 4)
    assert len(result) == 5
    for pos, (entry, target) in enumerate(zip(result, targets)):
        row = raw[pos].tolist()
        assert entry.token_id == target
        assert entry.logprob == pytest.approx(row[target], abs=1e-6)
        assert entry.rank == 1 + sum(1 for x in row if x > row[target])
        expected_top = sorted(range(20), key=lambda t: -row[t])[:4]
        assert entry.top == [(t, pytest.approx(row[t], abs=1e-6)) for t in expected_top]
    assert all(e.top == [] for e in prompt_logprobs(logits.to(device), targets, 0))
    with pytest.raises(ValueError):
        prompt_logprobs(logits, targets[:3], 1)


def test_rank_counts_ties_against_the_token():
    # vLLM's convention: rank = how many tokens are at least as likely.
    logits = torch.tensor([[1.0, 1.0, 0.0, 2.0]] * 3)
    ranks = [e.rank for e in prompt_logprobs(logits, [0, 1, 3], 0)]
    assert ranks == [3, 3, 1]


# --------------------------------------------------------------------------- failures


def test_non_finite_rows_fail_and_the_rest_sample(device):
    torch.manual_seed(12)
    logits = torch.randn(6, 30)
    logits[1, 4] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    logits[4, 10:] = float("-inf")  # a mask, not a failure
    params = [SamplingParams(temperature=0.0), SamplingParams(logprobs=2),
              SamplingParams(seed=5), SamplingParams(top_k=3), SamplingParams(top_p=0.9),
              SamplingParams(seed=6, logprobs=1)]
    seqs = [make_seq(p, seq_id=i, device=device) for i, p in enumerate(params)]
    expected_greedy = int(logits[0].argmax())
    out = Sampler(EOS).sample(logits.to(device), seqs)
    assert out.failed_rows == [1, 2, 3]
    assert [out.token_ids[i] for i in (1, 2, 3)] == [-1, -1, -1]
    assert out.token_ids[0] == expected_greedy
    assert 0 <= out.token_ids[4] < 10
    assert 0 <= out.token_ids[5] < 30
    assert out.logprobs[1] is None and out.logprobs[5].token_id == out.token_ids[5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_batch_fails_the_same_rows_in_one_argmax(monkeypatch, dtype, device):
    """A batch of plain greedy rows skips the general path (no float copy, no separate
    failure check) and still fails exactly the unusable rows; bf16 logits pick the tokens
    their float32 values would."""
    torch.manual_seed(13)
    logits = (torch.randn(7, 300) * 4).to(dtype)
    logits[1, 4] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    logits[4, 10:] = float("-inf")  # a mask, not a failure
    logits[5, 17] = logits[5, 200] = 99.0  # a tie: the first index, as argmax
    logits[6, 0], logits[6, 1] = float("nan"), float("inf")
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(7)]
    with_logprobs = [make_seq(SamplingParams(temperature=0.0, logprobs=0), seq_id=i)
                     for i in range(7)]
    general = Sampler(EOS).sample(logits.float(), with_logprobs)

    def forbidden(*args, **kwargs):
        raise AssertionError("a plain greedy batch should not reach here")

    monkeypatch.setattr(sampler_module, "apply_min_tokens", forbidden)
    out = Sampler(EOS).sample(logits.to(device), seqs)
    assert out.failed_rows == general.failed_rows == [1, 2, 3, 6]
    assert out.token_ids == general.token_ids
    assert out.token_ids[5] == 17 and 0 <= out.token_ids[4] < 10

    # One row that asks for more than the argmax sends the whole batch down the general path.
    for extra in [dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]),
                  dict(bad_words_token_ids=[[5]]), dict(repetition_penalty=1.2),
                  dict(min_tokens=2), dict(logprobs=1), dict(temperature=0.5)]:
        seqs[0] = make_seq(SamplingParams(**{"temperature": 0.0, **extra}), seq_id=0)
        with pytest.raises(AssertionError, match="plain greedy"):
            Sampler(EOS).sample(logits.to(device), seqs)


argmax_width = vector_widths(sampler_module, "_argmax_kernel")


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 300), (3, 13), (40, 30000)])
def test_the_compiled_argmax_is_torchs(rows, vocab, argmax_width):
    """The compiled checked argmax (float32 rows on the CPU) against the torch ops it
    replaces: random rows, ties (the first index wins, also across vector lanes and in the
    tail), the failing rows, a row of masks, strided rows; vocabularies that are not whole
    vectors (13, 300), and enough rows for several threads (40 x 30000)."""
    g = torch.Generator().manual_seed(rows + vocab)
    wide = (torch.randn(rows, vocab + 5, generator=g) * 4).round()  # many ties
    logits = wide[:, 2:2 + vocab]
    logits[0, vocab - 1] = logits[0].max() + 1  # the last element, in the scalar tail
    if rows > 1:
        logits[1, 1], logits[1, vocab // 2] = float("nan"), 1e30
    if rows > 2:
        logits[2, vocab - 2] = float("inf")
    if rows > 3:
        logits[3] = float("-inf")
        logits[4, :] = float("-inf")
        logits[4, 5] = logits[4, 11] = -1e38  # a tie of the only finite logits
        logits[5, 3] = logits[5, vocab - 1] = 1e9  # a tie between a lane and the tail
        logits[6, -1] = float("nan")
    want = sampler_module._checked_argmax_ref(logits)
    got = sampler_module._checked_argmax(logits)
    assert sampler_module._argmax_kernel() is not None  # the kernel ran, not the torch ops
    assert torch.equal(got, want)
    assert want[0] == vocab - 1
    if rows > 3:
        assert want[1:7].tolist() == [FAILED, FAILED, FAILED, 5, 3, FAILED]


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        Sampler(EOS).sample(torch.randn(2, 8), [make_seq(SamplingParams())])
