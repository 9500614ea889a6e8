"""Async scheduling (`heron.core.inflight`): each step is launched before the previous
step's tokens reach the host. Whatever a request asks for, its outputs must equal the
synchronous engine's, token for token and field for field, and every block, slot and
adapter reference must come back; only the step that delivers each token moves."""

from __future__ import annotations

import pytest

from heron.core.sampling_params import SamplingParams, StructuredOutput
from heron.core.sequence import SequenceStatus
from tests.engine_utils import assert_no_leaks, eager_steps, make_engine, run_to_end
from tests.hybrid_models import build_hybrid
from tests.lora_models import build_adapter
from tests.nllb_models import build_translator, corpus
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    base = build_tiny("llama", path, std=0.15)
    build_adapter(base, path / "qv", r=4, alpha=8, targets=("q_proj", "v_proj"))
    build_adapter(base, path / "o", r=2, alpha=4, targets=("o_proj",), seed=1)
    return path


def engines(path, **overrides):
    """The same settings, synchronous and async."""
    return [make_engine(path, **{"engine.async_scheduling": mode, **overrides})
            for mode in ("off", "on")]


class Logprob(float):
    """Equal to any logprob within 1e-5: the two engines may batch a request's steps
    differently, which moves the last bits (rounding both instead fails at the boundaries)."""

    def __eq__(self, other) -> bool:
        return abs(self - other) <= 1e-5

    __hash__ = float.__hash__


def described(out) -> dict:
    """Everything a request's output says, as plain values (logprobs as `Logprob`)."""
    def lp(entries):
        return None if entries is None else [
            None if e is None else (e.token_id, Logprob(e.logprob), e.rank,
                                    [(t, Logprob(v)) for t, v in e.top], e.text_offset)
            for e in entries]
    return {"cached": out.num_cached_tokens, "prompt_logprobs": lp(out.prompt_logprobs),
            "outputs": [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason,
                         o.error, lp(o.logprobs), o.score) for o in out.outputs]}


def run_both(path, waves, same_cache: bool = True, **overrides):
    """Run ``waves`` (lists of (request id, prompt, params, add_request kwargs)), each added
    once the one before has finished, on a synchronous and an async engine; assert that
    every output is the same (with ``same_cache``, ``cached_tokens`` too) and nothing
    leaks. The synchronous engine's outputs and the engines; without ``same_cache``, each
    engine's outputs."""
    results = []
    pair = engines(path, **overrides)
    for engine in pair:
        done = {}
        for wave in waves:
            for rid, prompt, params, kw in wave:
                engine.add_request(rid, prompt, params, **kw)
            done |= {rid: described(out) for rid, out in run_to_end(engine).items()}
        assert_no_leaks(engine)
        results.append(done)
    sync, async_ = results
    assert sync.keys() == async_.keys()
    for rid in sync:
        if same_cache:
            assert async_[rid] == sync[rid], rid
        else:
            assert {**async_[rid], "cached": None} == {**sync[rid], "cached": None}, rid
    return (sync, pair) if same_cache else (sync, async_)


def greedy(**kw):
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})


def seeded(seed, **kw):
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.9, "seed": seed,
                             "ignore_eos": True, **kw})


def sampling_wave(engine) -> list:
    """Greedy, seeded sampling with filters, penalties and logit bias, structured outputs,
    min_tokens, stop strings and stop token ids (found a step late), logprobs, prompt
    logprobs, n > 1, beams: requests for one batch, each finishing at its own step.
    ``engine`` (any) picks the stops."""
    text = engine.generate(["Paged attention"], greedy(ignore_eos=True, max_tokens=20))[0]
    ids = text.outputs[0].token_ids
    stop_text = engine.tokenizer.decode(ids[5:7])  # ends a stream a few tokens in
    return [
        ("greedy", "Paged attention", greedy(), {}),
        ("stop-id", "Paged attention", greedy(stop_token_ids=[ids[3]]), {}),
        ("stop-str", "Paged attention", greedy(stop=[stop_text]), {}),
        ("stop-str-kept", "Paged attention",
         greedy(stop=[stop_text], include_stop_str_in_output=True), {}),
        ("filters", "The quick brown fox", seeded(1, top_k=20, top_p=0.8, min_p=0.02), {}),
        ("penalties", "The quick brown fox", seeded(2, repetition_penalty=1.3,
                                                    frequency_penalty=0.5,
                                                    presence_penalty=0.4), {}),
        ("logit-bias", "The quick brown fox", seeded(6, logit_bias={ids[1]: 3.0, ids[2]: -4.0},
                                                     repetition_penalty=1.2, logprobs=2), {}),
        ("regex", "emoji", seeded(7, structured_outputs=StructuredOutput(
            regex=r"[a-z]{1,4}( [a-z]{1,4}){0,3}")), {}),
        ("json", "The quick", greedy(structured_outputs=StructuredOutput(
            json={"type": "object", "properties": {"a": {"type": "boolean"}},
                  "required": ["a"], "additionalProperties": False})), {}),
        ("min-tokens", "def add(a, b):", seeded(3, min_tokens=6, stop_token_ids=[ids[0]],
                                                ignore_eos=False), {}),
        ("logprobs", "Caf\u00e9", seeded(4, logprobs=3, max_tokens=7), {}),
        ("prompt-logprobs", "The quick brown fox jumps", greedy(prompt_logprobs=2,
                                                                 logprobs=1), {}),
        ("n", "emoji", seeded(5, n=3, max_tokens=9), {}),
        ("beams", "The quick", greedy(num_beams=3, n=2, max_tokens=6), {}),
        ("ids", [5, 6, 7, 8, 9], greedy(max_tokens=1), {}),
    ]


def test_every_sampling_feature_gives_the_same_outputs(llama):
    done, _ = run_both(llama, [sampling_wave(make_engine(llama))])
    finish = {rid: {o[3] for o in d["outputs"]} for rid, d in done.items()}
    assert finish["stop-id"] == finish["stop-str"] == finish["stop-str-kept"] == {"stop"}
    assert len(done["n"]["outputs"]) == 3 and len(done["beams"]["outputs"]) == 2


def test_siblings_without_a_seat_give_the_same_outputs(llama):
    """``n > 1`` in a batch too small for every sibling: those that find no seat wait, with
    their first token, to compute the prompt again."""
    wave = [("n", "The quick brown fox", seeded(1, n=4, max_tokens=6), {}),
            ("one", "emoji", seeded(2, max_tokens=1, n=2), {})]
    run_both(llama, [wave], **{"engine.max_num_seqs": 2})


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_and_the_prefix_cache_give_the_same_outputs(llama, preemption):
    """A pool too small for the batch (sequences preempted while their tokens are in
    flight), then a second wave that starts with the first wave's prompts and outputs
    (prefix-cache hits, ``cached_tokens`` compared too)."""
    prompts = ["The quick brown fox", "Paged attention keeps", "def add(a, b):", "emoji"]
    first = [(f"a{i}", p, seeded(i, max_tokens=24), {}) for i, p in enumerate(prompts)]
    sync, pair = run_both(llama, [first], **{"engine.block_size": 4,
                                             "engine.num_kv_blocks": 20,
                                             "engine.preemption": preemption,
                                             "engine.num_swap_blocks": 16})
    assert all(e.scheduler.num_preemptions > 0 for e in pair)
    tokenizer = pair[0].tokenizer
    second = [(f"b{i}", tokenizer.encode(p) + sync[f"a{i}"]["outputs"][0][1] + [7, 8],
               greedy(ignore_eos=True), {}) for i, p in enumerate(prompts)]
    done, _ = run_both(llama, [first, second])
    assert all(done[f"b{i}"]["cached"] > 0 for i in range(len(prompts)))


def test_adapters_give_the_same_outputs(llama):
    wave = [(f"{name or 'base'}-{i}", prompt, seeded(i), {"adapter": name})
            for i, (name, prompt) in enumerate([("qv", "The quick brown fox"), (None, "emoji"),
                                                ("o", "def add(a, b):"), ("qv", "Caf\u00e9"),
                                                (None, "Paged attention")])]
    run_both(llama, [wave], **{"lora.adapters": {"qv": str(llama / "qv"),
                                                 "o": str(llama / "o")}})


@pytest.mark.parametrize("kind", ["bamba", "mamba2"])
def test_hybrid_models_give_the_same_outputs_and_snapshots(tmp_path, kind):
    """SSM states in slots. A stop found a step late has run the stopping token through
    the model: its KV and state are the token's own, so the async engine caches one block
    more than the synchronous one where that token fills a block, with the state snapshot
    taken at the finish. A follow-up that hits it must continue exactly as the synchronous
    engine's follow-up, which computes that block."""
    build_hybrid(kind, tmp_path)
    settings = {"engine.block_size": 4, "engine.max_num_batched_tokens": 16,
                "prefix_cache.snapshot_admission": "every_block"}
    probe = make_engine(tmp_path, **settings)
    prompts = ["Paged attention", "The quick brown fox jumps over", "def add(a, b):"]
    first = []
    for i, prompt in enumerate(prompts):
        ids = probe.generate([prompt], greedy(ignore_eos=True, max_tokens=24))[0]
        ids, start = ids.outputs[0].token_ids, len(probe.tokenizer.encode(prompt))
        # the first token (past the third) that is new in the output and fills a block
        j = next(j for j in range(3, len(ids))
                 if (start + j + 1) % 4 == 0 and ids[j] not in ids[:j])
        first.append((f"a{i}", prompt, greedy(stop_token_ids=[ids[j]], ignore_eos=True,
                                              max_tokens=24), {}))
    first.append(("sampled", "emoji", seeded(9, n=2), {}))
    sync, _ = run_both(tmp_path, [first], **settings)
    assert all(sync[f"a{i}"]["outputs"][0][3] == "stop" for i in range(len(prompts)))
    second = [(f"b{i}", probe.tokenizer.encode(p) + sync[f"a{i}"]["outputs"][0][1] + [7, 8, 9],
               greedy(ignore_eos=True), {}) for i, p in enumerate(prompts)]
    sync, async_ = run_both(tmp_path, [first, second], same_cache=False, **settings)
    for i in range(len(prompts)):
        assert async_[f"b{i}"]["cached"] == sync[f"b{i}"]["cached"] + 4


def test_translations_give_the_same_outputs(tmp_path):
    """An encoder-decoder: greedy translations take placeholders, beam searches do not."""
    tokenizer, hf = build_translator(tmp_path)
    words = " ".join(corpus(5, seed=1)).split()
    prompt = [hf.config.decoder_start_token_id, tokenizer.convert_tokens_to_ids("fra_Latn")]
    wave = [(f"t{i}", prompt, greedy(max_tokens=10) if i % 2 == 0 else
             greedy(num_beams=3, max_tokens=8), {"encoder_prompt": tokenizer(
                 " ".join(words[:n])).input_ids}) for i, n in enumerate((3, 8, 20, 12, 5))]
    run_both(tmp_path, [wave], **{"engine.max_num_seqs": 6})


def test_steps_launch_before_the_tokens_land(llama):
    """The mechanism: with async scheduling, step k's forward runs before step k - 1's
    token reaches the caller; a sequence whose token in flight is its last by length is
    not scheduled again (as many forwards as the synchronous engine), one that stops on
    a token found a step late runs one step more."""
    for engine in engines(llama):
        calls, delivered = [], []
        forward = eager_steps(engine).runner.forward

        def counting(batch, forward=forward):
            calls.append(len(delivered))
            return forward(batch)

        engine.runner.forward = counting
        engine.add_request("a", "The quick brown fox", greedy(max_tokens=5, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                delivered += out.outputs[0].new_token_ids
        lag = 1 if engine.async_scheduling else 0
        # forward k (from 0) runs with k - lag tokens delivered: the prefill, then 4 decodes
        assert calls == [max(0, k - lag) for k in range(5)]
        assert len(delivered) == 5
        stop = delivered[2]
        calls.clear(), delivered.clear()
        engine.add_request("b", "The quick brown fox", greedy(stop_token_ids=[stop]))
        run_to_end(engine)
        assert len(calls) == 3 + lag  # the token that stops it is the third
        assert_no_leaks(engine)


def test_an_abort_with_a_token_in_flight_frees_everything(llama):
    _, engine = engines(llama)
    other = make_engine(llama).generate(["emoji"], greedy(ignore_eos=True))[0]
    engine.add_request("gone", "The quick brown fox", greedy(ignore_eos=True))
    engine.add_request("stays", "emoji", greedy(ignore_eos=True))
    for _ in range(3):
        engine.step()
    gone = next(s for s in engine.scheduler.running if s.request_id == "gone")
    assert gone.token_ids[-1] < 0  # its token of the step in flight
    aborted = engine.abort("gone")
    assert aborted.outputs[0].finish_reason == "abort"
    assert gone.status is SequenceStatus.FINISHED and min(gone.token_ids) >= 0
    done = run_to_end(engine)
    assert done.keys() == {"stays"}
    assert done["stays"].outputs[0].token_ids == other.outputs[0].token_ids
    assert_no_leaks(engine)
    engine.add_request("last", "emoji", greedy(ignore_eos=True, max_tokens=3))
    engine.step()
    engine.step()
    engine.abort("last")  # the only request, aborted with its token in flight
    assert not engine.has_unfinished()
    assert engine.step() == [] and not engine.has_unfinished()
    assert_no_leaks(engine)


def test_async_scheduling_settings(llama):
    assert not make_engine(llama).async_scheduling  # "auto" on the CPU
    with pytest.raises(ValueError, match="speculative"):
        make_engine(llama, **{"engine.async_scheduling": "on", "speculative.method": "ngram"})
    engine = make_engine(llama, **{"engine.async_scheduling": "auto",
                                   "speculative.method": "ngram"})
    assert not engine.async_scheduling
