"""Speculative decoding on a tiny Llama: drafts verified in the batch never change outputs.

Greedy: token for token the same with and without n-gram drafts, in mixed batches, with
opt-outs and preemption. Sampling: seeded requests give the same tokens, and the joint
distribution of two sampled tokens with drafts matches transformers' probabilities under
a chi-square test that a deliberately broken verifier fails.
"""

from __future__ import annotations

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from heron.core.speculative import Proposer
from heron.plugins.mtp.ngram import NgramIndex
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.tiny_models import build_tiny

NGRAM = {"speculative.method": "ngram", "speculative.num_speculative_tokens": 3,
         "speculative.prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, build_tiny("llama", path)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Bamba: Mamba2 layers, whose states cannot step back over rejected drafts."""
    from tests.hybrid_models import build_hybrid
    path = tmp_path_factory.mktemp("bamba")
    return path, build_hybrid("bamba", path)


def prompts() -> list[list[int]]:
    """Prompts of different lengths; some repeat spans, as text that quotes itself does."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (5, 12, 30, 47, 9, 21):
        ids = torch.randint(3, 200, (n,), generator=g).tolist()
        out.append(ids + ids[: n // 2] if n % 2 else ids)
    return out


def run(engine, params: list[SamplingParams]) -> list[list[int]]:
    for i, (ids, p) in enumerate(zip(prompts(), params)):
        engine.add_request(f"r{i}", ids, p)
    done = run_to_end(engine)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(params))]


def lookup(tokens: list[int], k: int) -> list[int]:
    return NgramIndex(2, 3).lookup(tokens, k)


def test_ngram_lookup_drafts_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 4, 9, 2, 3, 4, 7, 2, 3, 4], 2) == [7, 2]  # latest, 3-gram
    assert lookup([5, 6, 1, 2, 8, 8, 1, 2], 5) == [8, 8, 1, 2]
    assert lookup([1, 2, 3, 4], 3) == []  # the suffix never appeared before
    assert lookup([7, 7, 7], 3) == [7]  # overlapping: what followed the 2-gram
    assert lookup([7, 7], 3) == []  # no earlier 2-gram


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by brute force: every n-gram size, every earlier start, latest first."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 4), (2, 5)])
def test_the_ngram_index_of_a_growing_sequence_finds_what_a_full_scan_finds(min_n, max_n):
    g = torch.Generator().manual_seed(min_n * 10 + max_n)
    for _ in range(20):
        tokens = torch.randint(0, 6, (3,), generator=g).tolist()  # few symbols: many repeats
        index = NgramIndex(min_n, max_n)
        for _ in range(60):  # a step at a time, and now and then several accepted at once
            tokens += torch.randint(0, 6, (int(torch.randint(1, 4, (1,), generator=g)),),
                                    generator=g).tolist()
            assert index.lookup(tokens, 3) == scan(tokens, 3, min_n, max_n)


class OracleProposer(Proposer):
    """Drafts the known continuation with one token spoiled at a position that varies with
    the output length (past the last draft: all right), so every accepted length from 0 to
    k occurs."""

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        self.refs = {tuple(p): c for p, c in zip(prompts, continuations)}

    def propose(self, seqs, k):
        drafts = []
        for seq in seqs:
            ref, done = self.refs[tuple(seq.prompt_token_ids)], seq.num_output_tokens
            draft = list(ref[done:done + k])
            spoil = (done * 5 + len(seq.prompt_token_ids)) % (k + 1)
            if spoil < len(draft):
                draft[spoil] = 3 if draft[spoil] != 3 else 4
            drafts.append(draft)
        return drafts


@pytest.mark.parametrize("overrides", [
    {},
    {"engine.max_num_seqs": 2},  # requests join while others verify drafts
    {"engine.num_kv_blocks": 30, "engine.block_size": 4},  # preemption, rollback at edges
], ids=["one-batch", "staggered", "preempted"])
@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_greedy_outputs_are_identical_with_drafts(request, model, overrides, proposer):
    path, _ = request.getfixturevalue(model)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             speculative=i % 3 != 2)  # every third opts out
              for i in range(len(prompts()))]
    plain = run(make_engine(path, **overrides), params)
    engine = make_engine(path, **overrides, **NGRAM)
    if proposer == "oracle":
        engine.proposer = OracleProposer(prompts(), plain)
    assert run(engine, params) == plain
    stats = engine.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens
    if proposer == "oracle":  # every accepted length occurred
        assert stats.drafts > stats.accepted_at[0] >= stats.accepted_at[1] > 0
        assert stats.accepted_at[1] >= stats.accepted_at[2] > 0
    if "engine.num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(tiny):
    path, _ = tiny
    # requests end one after another: 6 run, then fewer
    params = [SamplingParams(max_tokens=6 + 6 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts()))]
    plain = run(make_engine(path), params)
    engine = make_engine(path, **NGRAM, **{"speculative.disable_by_batch_size": 2})
    engine.proposer = OracleProposer(prompts(), plain)
    running_when_asked = []
    propose = engine.proposer.propose

    def recording(seqs, k):
        running_when_asked.append(len(engine.scheduler.running))
        return propose(seqs, k)

    engine.proposer.propose = recording
    assert run(engine, params) == plain
    assert running_when_asked and max(running_when_asked) == 2
    assert engine.spec_stats.accepted_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_seeded_sampling_gives_the_same_tokens_with_drafts(request, model):
    path, _ = request.getfixturevalue(model)
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=100 + i,
                             ignore_eos=True, repetition_penalty=1.1,
                             logit_bias={5: 2.0, 9: -1.5} if i % 2 else {})
              for i in range(len(prompts()))]
    plain = run(make_engine(path), params)
    engine = make_engine(path, **NGRAM)
    engine.proposer = OracleProposer(prompts(), plain)  # the same seeds' continuations
    assert run(engine, params) == plain
    assert engine.spec_stats.accepted_tokens > 0


class ScriptedProposer(Proposer):
    """Drafts ``script[token]`` after a sequence whose last token is ``token``."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script = script

    def propose(self, seqs, k):
        return [self.script.get(seq.token_ids[-1], [])[:k] for seq in seqs]


def test_acceptance_is_counted_per_position_and_rejected_blocks_are_freed(tiny):
    """Drafts built from the greedy continuation: right, right, wrong."""
    path, _ = tiny
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = make_engine(path).generate([prompt], params)[0].outputs[0].token_ids
    assert len(set(ref[:5])) == 5  # distinct: the script below is unambiguous
    wrong = next(t for t in range(3, 200) if t != ref[3])
    engine = make_engine(path, **{"engine.block_size": 4, **NGRAM})
    engine.proposer = ScriptedProposer({ref[0]: [ref[1], ref[2], wrong]})
    seen_blocks = []
    engine.add_request("r", prompt, params)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            seen_blocks.append((len(seq.token_ids), len(seq.block_table)))
    stats = engine.spec_stats
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (1, 3, 2)
    assert stats.accepted_at == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 3)
    assert stats.mean_accepted_length == 3.0
    # never more blocks than the tokens need once a step is done
    assert all(blocks <= -(-n // 4) for n, blocks in seen_blocks)
    assert_no_leaks(engine)


class BlindSampler:
    """A broken verifier: the draft after ``t1`` is taken whatever the target says."""

    def __init__(self, sampler, script: dict[int, list[int]]) -> None:
        self.sampler, self.script = sampler, script

    def sample(self, logits, seqs):
        result = self.sampler.sample(logits, seqs)
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens == 1 and seq.token_ids[-1] in self.script:
                result.token_ids[i] = self.script[seq.token_ids[-1]][0]
        return result

    def launch(self, logits, seqs):  # rows without drafts: sampled as ever
        return self.sampler.launch(logits, seqs)


CHI2_DF8_P001 = 26.12  # the chi-square quantile for 8 degrees of freedom at p = 0.001


@pytest.mark.parametrize("verifier", ["exact", "blind"])
def test_sampled_pairs_follow_the_targets_distribution(tiny, verifier):
    """Top-3 sampling of two tokens, a draft (the target's second choice) proposed for the
    second: the 9 pairs' counts over 3000 seeded requests against transformers' p(t1) ·
    p(t2 | t1)."""
    path, hf = tiny
    prompt = prompts()[1]
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        top1 = first.topk(3).indices.tolist()
        nexts = torch.softmax(hf(torch.tensor([prompt + [t] for t in top1])).logits[:, -1], -1)
    expected, script = {}, {}
    p1 = first[top1] / first[top1].sum()
    for a, t1 in enumerate(top1):
        top2 = nexts[a].topk(3).indices.tolist()
        p2 = nexts[a][top2] / nexts[a][top2].sum()
        script[t1] = [top2[1]]
        for b, t2 in enumerate(top2):
            expected[t1, t2] = (p1[a] * p2[b]).item()
    engine = make_engine(path, **NGRAM, **{"engine.max_num_seqs": 64})
    engine.proposer = ScriptedProposer(script)
    if verifier == "blind":
        engine.sampler = BlindSampler(engine.sampler, script)
    num = 3000
    for i in range(num):
        engine.add_request(f"s{i}", prompt, SamplingParams(
            max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True))
    counts = dict.fromkeys(expected, 0)
    for out in run_to_end(engine).values():
        counts[tuple(out.outputs[0].token_ids[:2])] += 1
    chi2 = sum((counts[c] - num * p) ** 2 / (num * p) for c, p in expected.items())
    assert engine.spec_stats.drafts == num
    if verifier == "exact":
        assert chi2 < CHI2_DF8_P001, (chi2, counts)
        assert 0 < engine.spec_stats.accepted_tokens < num
    else:
        assert chi2 > 10 * CHI2_DF8_P001, (chi2, counts)


def test_drafts_are_verified_under_each_requests_adapter(tiny, tmp_path):
    """Base and LoRA requests in one batch, drafts from the base model's continuations:
    right for base rows, mostly wrong for adapter rows; outputs are unchanged."""
    from tests.lora_models import STANDARD, build_adapter

    path, hf = tiny
    name, kw = next(iter(STANDARD.items()))
    build_adapter(hf, tmp_path / name, **kw)
    lora = {"lora.adapters": {name: str(tmp_path / name)}}
    jobs = [(p, adapter) for p in prompts()[:3] for adapter in (None, name)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def go(engine):
        for i, (prompt, adapter) in enumerate(jobs):
            engine.add_request(f"j{i}", prompt, params, adapter=adapter)
        done = run_to_end(engine)
        return [done[f"j{i}"].outputs[0].token_ids for i in range(len(jobs))]

    plain = go(make_engine(path, **lora))
    engine = make_engine(path, **lora, **NGRAM)
    base = [out for out, (_, adapter) in zip(plain, jobs) if adapter is None]
    engine.proposer = OracleProposer(prompts()[:3], base)
    assert go(engine) == plain
    assert plain[0] != plain[1]  # the adapter changes the output
    assert 0 < engine.spec_stats.accepted_tokens < engine.spec_stats.draft_tokens
    assert engine.num_adapters_in_use == 0
    assert_no_leaks(engine)


def test_speculation_is_refused_where_it_cannot_run(tiny, tmp_path):
    from tests.hybrid_models import build_hybrid

    path, _ = tiny
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'.*'ngram'"):
        make_engine(path, **{"speculative.method": "eagle"})
    build_hybrid("mamba2", tmp_path)  # no attention layers to shape an MTP layer on
    with pytest.raises(ValueError, match="hybrids with attention layers"):
        make_engine(tmp_path, **{"speculative.method": "mtp"})


@pytest.mark.parametrize("method", ["", "ngram"])
def test_prompt_lookup_without_another_method_is_flagged(tiny, method, caplog):
    make_engine(tiny[0], **{"speculative.method": method, "speculative.prompt_lookup": True})
    assert f"prompt_lookup does nothing with method {method!r}" in caplog.text


def test_siblings_of_a_request_with_n_choices_keep_their_streams(tiny):
    path, _ = tiny
    params = [SamplingParams(n=3, max_tokens=16, temperature=1.0, top_k=5, seed=7 + i,
                             ignore_eos=True) for i in range(len(prompts()))]

    def choices(engine):
        for i, (ids, p) in enumerate(zip(prompts(), params)):
            engine.add_request(f"r{i}", ids, p)
        done = run_to_end(engine)
        return [[c.token_ids for c in done[f"r{i}"].outputs] for i in range(len(params))]

    plain = choices(make_engine(path))
    engine = make_engine(path, **NGRAM)
    engine.proposer = OracleProposer(prompts(), [c[0] for c in plain])  # choice 0's tokens
    assert choices(engine) == plain
    assert engine.spec_stats.accepted_tokens > 0
    assert_no_leaks(engine)
