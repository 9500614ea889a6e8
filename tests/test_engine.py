"""Engine behaviour on a tiny model: seeds, stops, limits, aborts, faults, accounting."""

from __future__ import annotations

import pytest

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leaks, eager_steps, make_engine
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny("llama", path, std=0.15)  # flatter logits: sampling has choices to make
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir, **{"engine.block_size": 8, "engine.max_num_batched_tokens": 48})


def assert_idle(engine):
    assert_no_leaks(engine)


def sampled(**kw):
    return SamplingParams(**{"max_tokens": 24, "temperature": 1.0, "ignore_eos": True, **kw})


def test_same_seed_same_output_regardless_of_batch(engine):
    prompt = "The quick brown fox"
    alone = engine.generate([prompt], sampled(seed=1234))[0].outputs[0].token_ids
    others = ["Paged attention keeps", "def add(a, b):", "Caf\u00e9 na\u00efve", "emoji"]
    for position in (0, 2, 4):
        prompts = others[:position] + [prompt] + others[position:]
        params = [sampled(seed=7 + i) if i % 2 else sampled() for i in range(len(prompts))]
        params[position] = sampled(seed=1234)
        outs = engine.generate(prompts, params)
        assert outs[position].outputs[0].token_ids == alone
    other_seed = engine.generate([prompt], sampled(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_idle(engine)


def test_n_sequences_share_a_prompt_and_differ(engine):
    out = engine.generate(["The quick brown fox"], sampled(n=3, seed=5))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert_idle(engine)


def test_stop_string_cuts_exactly_before_it_also_across_tokens(engine):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = engine.generate(["Paged attention"], greedy)[0].outputs[0]
    tokens = [engine.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(5, len(tokens) - 1) if tokens[i] and tokens[i + 1])
    stop = tokens[i][-1:] + tokens[i + 1][:1]
    cut = full.text.index(stop)
    out = engine.generate(["Paged attention"],
                          SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                         stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = engine.generate(["Paged attention"],
                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                          stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full.text[:cut + len(stop)]
    assert_idle(engine)


def test_stop_token_ids_min_tokens_and_length(engine):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = engine.generate(["def add"], greedy)[0].outputs[0].token_ids
    stop_id = next(t for t in full[3:] if engine.tokenizer.decode([t]))  # one with text
    out = engine.generate(["def add"], SamplingParams(max_tokens=20, temperature=0.0,
                                                      stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full[:full.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # the stop token's text is left out, unless asked for (as vLLM does)
    assert out.text == engine.tokenizer.decode(out.token_ids[:-1])
    kept = engine.generate(["def add"], SamplingParams(
        max_tokens=20, temperature=0.0, stop_token_ids=[stop_id],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == engine.tokenizer.decode(out.token_ids) != out.text
    held = engine.generate(["def add"], SamplingParams(
        max_tokens=20, temperature=0.0, stop_token_ids=[stop_id], min_tokens=10))[0].outputs[0]
    assert len(held.token_ids) >= 10 and stop_id not in held.token_ids[:9]
    length = engine.generate(["def add"], SamplingParams(max_tokens=5, temperature=0.0,
                                                         ignore_eos=True))[0].outputs[0]
    assert (len(length.token_ids), length.finish_reason) == (5, "length")
    assert_idle(engine)


def test_prompt_logprobs_cover_every_prompt_token(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3,
                                                   logprobs=2, temperature=0.0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
    assert all(len(e.top) == 3 for e in out.prompt_logprobs[1:])
    gen = out.outputs[0].logprobs
    assert len(gen) == 2 and all(e.rank == 1 and len(e.top) == 2 for e in gen)


def test_bad_requests_are_refused_with_reasons(engine):
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [5] * 600, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("vocab", [5, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("p", "hi", SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    assert_idle(engine)


def test_abort_mid_prefill_and_mid_decode_frees_everything(engine):
    engine.add_request("a", [7] * 200, sampled(max_tokens=50))  # several prefill chunks
    engine.add_request("b", "The quick brown fox", sampled(max_tokens=50))
    engine.step()
    assert engine.num_blocks_in_use > 0
    aborted = engine.abort("a")
    assert aborted.outputs[0].finish_reason == "abort"
    for _ in range(3):
        engine.step()
    engine.abort("b")
    engine.abort("unknown")  # ignored
    assert_idle(engine)


def test_a_family_fault_fails_only_that_step_and_frees(model_dir):
    engine = eager_steps(make_engine(model_dir))
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def failing_once(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_forward(batch)

    engine.runner.forward = failing_once
    engine.add_request("x", "The quick", sampled(max_tokens=8))
    engine.step()
    outs = engine.step()
    assert outs[0].outputs[0].finish_reason == "error" and "boom" in outs[0].outputs[0].error
    assert_idle(engine)
    after = engine.generate(["The quick"], sampled(max_tokens=4))[0].outputs[0]
    assert after.finish_reason == "length"
    assert_idle(engine)


def test_preempted_then_finished_requests_return_every_block(model_dir):
    engine = make_engine(model_dir, **{"engine.block_size": 4, "engine.num_kv_blocks": 24,
                                       "prefix_cache.enabled": False})
    outs = engine.generate(["The quick brown fox"] * 6, sampled(max_tokens=40, seed=3))
    assert engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_idle(engine)


def test_context_settings_past_the_model_or_the_cache_are_logged(model_dir, caplog):
    """``max_model_len`` past the model's positions is cut to them, and a KV cache smaller
    than the context refuses longer requests: both said at start-up, not found later."""
    engine = make_engine(model_dir, **{"model.max_model_len": 100_000,
                                       "engine.num_kv_blocks": 4, "engine.block_size": 16})
    limit = engine.runner.info.max_context_len
    assert engine.max_model_len == limit
    assert "model.max_model_len 100000 is past what" in caplog.text
    assert "the KV cache holds 64 tokens" in caplog.text and f"max_model_len {limit}" in caplog.text


def test_a_kv_cache_too_large_to_allocate_names_the_key(model_dir):
    with pytest.raises(RuntimeError, match=r"cannot be allocated on cpu: lower "
                                           r"engine\.kv_cache_memory_gb"):
        make_engine(model_dir, **{"engine.kv_cache_memory_gb": 1e9})
