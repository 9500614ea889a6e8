"""The prefix cache, prompt sharing and preemption in a real Engine on a tiny model.

Every reuse claim is checked against the same engine code with the cache disabled (or an
unconstrained pool): the outputs must not change.
"""

from __future__ import annotations

import random

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from heron.core.sequence import SequenceStatus
from tests.engine_utils import assert_no_leaks, eager_steps, make_engine, run_one, run_to_end
from tests.tiny_models import build_tiny

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny("llama", path, std=0.15, max_position_embeddings=2048)
    return path


def engine_for(model_dir, **overrides):
    settings = {"engine.block_size": BS, "engine.max_num_batched_tokens": 256,
                "engine.num_kv_blocks": 512, **overrides}
    return make_engine(model_dir, **settings)


@pytest.fixture(scope="module")
def cold(model_dir):
    return engine_for(model_dir, **{"prefix_cache.enabled": False})


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


PREFIX = tokens(1000, seed=1)


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0,
                          **kw)


def run(engine, prompt, params=None, **kw):
    return run_one(engine, prompt, params or greedy(), **kw)


def same_tokens_and_logprobs(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    got = torch.tensor([lp.logprob for lp in a.outputs[0].logprobs])
    want = torch.tensor([lp.logprob for lp in b.outputs[0].logprobs])
    assert torch.allclose(got, want, atol=1e-4)


def test_a_shared_1000_token_prefix_is_reused_without_changing_the_output(model_dir, cold):
    engine = engine_for(model_dir)
    first = run(engine, PREFIX + tokens(20, seed=2))
    assert first.num_cached_tokens == 0
    prompt = PREFIX + tokens(30, seed=3)
    second = run(engine, prompt)
    assert second.num_cached_tokens >= len(PREFIX) // BS * BS
    assert second.num_cached_tokens < len(prompt)
    same_tokens_and_logprobs(second, run(cold, prompt))
    assert run(cold, prompt).num_cached_tokens == 0
    assert_no_leaks(engine)


def test_decoding_beside_requests_with_the_same_prefix_reads_it_once(model_dir, cold,
                                                                    monkeypatch):
    import heron.core.ops.attention as attention
    split = attention._shared_prefix_decode
    calls = []
    monkeypatch.setattr(attention, "_shared_prefix_decode",
                        lambda *a: calls.append(a[3]) or split(*a))
    # the torch ops' decode (the compiled CPU kernel reads every context whole, faster),
    # eager (a replayed step reads no host values, so makes no plan)
    engine = eager_steps(engine_for(model_dir, **{"engine.cpu_kernels": False}))
    run(engine, PREFIX + tokens(5, seed=20))  # caches the prefix
    prompts = {f"p{i}": PREFIX[:700 + 100 * i] + tokens(10 + i, seed=30 + i) for i in range(4)}
    prompts["other"] = tokens(300, seed=40)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens=16))
    outs = run_to_end(engine)
    # the four share 43 blocks (688 keys), then their own; the fifth reads all its own keys
    assert any(len(plan.groups) == 1 and len(plan.groups[0][1]) == 688 for plan in calls)
    for request_id, prompt in prompts.items():
        same_tokens_and_logprobs(outs[request_id], run(cold, prompt, greedy(max_tokens=16)))
    assert_no_leaks(engine)


def test_tenants_never_share_blocks_or_reveal_hits(model_dir):
    engine = engine_for(model_dir)
    prompt = PREFIX[:300]
    run(engine, prompt, tenant="alice")
    cache = engine.prefix_cache
    tenants = {b: ns.tenant for b in range(engine.num_kv_blocks)
               if (ns := cache.namespace_of(b)) is not None}
    alice_blocks = {b for b, tenant in tenants.items() if tenant == "alice"}
    assert len(alice_blocks) == (300 + 12 - 1) // BS  # prompt and answer, as written

    engine.add_request("bob", prompt, greedy(), tenant="bob")
    bob = engine._requests["bob"].seqs[0]
    seen = set()
    while engine.has_unfinished():
        seen |= set(bob.block_table)
        outs = engine.step()
    seen |= set(bob.block_table)
    assert seen and not seen & alice_blocks  # checked on the pool's block ids, every step
    assert outs[0].num_cached_tokens == 0
    assert {cache.namespace_of(b).tenant for b in range(engine.num_kv_blocks)
            if cache.namespace_of(b) is not None} == {"alice", "bob"}
    # the control: the same tenant does hit
    assert run(engine, prompt, tenant="bob").num_cached_tokens == 299 // BS * BS
    assert_no_leaks(engine)


def test_the_next_turn_reuses_the_previous_answer(model_dir, cold):
    engine = engine_for(model_dir)
    turn1 = PREFIX[:200]
    answer = run(engine, turn1, greedy(max_tokens=40)).outputs[0].token_ids
    turn2 = turn1 + answer + tokens(10, seed=4)
    out = run(engine, turn2)
    written = len(turn1) + len(answer) - 1  # the last answer token was never fed back
    assert out.num_cached_tokens == written // BS * BS
    same_tokens_and_logprobs(out, run(cold, turn2))


def test_prompt_logprobs_cover_every_position_on_a_warm_cache(model_dir, cold):
    engine = engine_for(model_dir)
    prompt = PREFIX[:100]
    run(engine, prompt)
    out = run(engine, prompt, greedy(prompt_logprobs=2))
    ref = run(cold, prompt, greedy(prompt_logprobs=2))
    assert out.num_cached_tokens == 0  # nothing was reused: every position was computed
    assert len(out.prompt_logprobs) == len(prompt) == len(ref.prompt_logprobs)
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    want = torch.tensor([e.logprob for e in ref.prompt_logprobs[1:]])
    assert torch.allclose(got, want, atol=1e-4)


def test_a_failed_step_caches_only_what_was_written(model_dir, cold):
    engine = eager_steps(engine_for(model_dir, **{"engine.max_num_batched_tokens": 64}))
    prompt = PREFIX[:200]
    forward, calls = engine.runner.forward, []

    def fail_second_step(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return forward(batch)

    engine.runner.forward = fail_second_step
    failed = run(engine, prompt)
    engine.runner.forward = forward
    assert failed.outputs[0].finish_reason == "error"
    assert engine.prefix_cache.num_cached_blocks == 64 // BS  # the first chunk only
    again = run(engine, prompt)
    assert again.num_cached_tokens == 64
    same_tokens_and_logprobs(again, run(cold, prompt))
    assert_no_leaks(engine)


def test_n_sequences_fork_the_prompt_and_copy_its_last_block(model_dir):
    engine = engine_for(model_dir, **{"prefix_cache.enabled": False})
    prompt = PREFIX[:37]  # two whole blocks and a partial one
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("fork", prompt, params)
    seqs = engine._requests["fork"].seqs
    while not all(s.status is SequenceStatus.RUNNING for s in seqs):
        engine.step()
    tables = [s.block_table for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # whole blocks shared...
    assert engine.block_pool.refcount(tables[0][0]) == 4
    assert len({t[2] for t in tables}) == 4  # ...the partial one copied
    while engine.has_unfinished():
        outs = engine.step()
    forked = [o.token_ids for o in outs[0].outputs]
    # sibling i samples with seed + i: the same as a request of its own with that seed
    for i, got in enumerate(forked):
        alone = run(engine, prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=7 + i,
                                                   ignore_eos=True))
        assert got == alone.outputs[0].token_ids
    assert len(set(map(tuple, forked))) > 1
    assert_no_leaks(engine)


def test_n_sequences_with_a_full_pool_fall_back_to_their_own_prefill(model_dir):
    # four sequences of 37 + 20 tokens need 16 blocks, the pool has 10: siblings that find
    # no block wait and compute the prompt again (mostly from the cache)
    engine = engine_for(model_dir, **{"engine.num_kv_blocks": 10, "engine.max_num_seqs": 2})
    out = run(engine, PREFIX[:37], SamplingParams(n=4, max_tokens=20, temperature=0.0,
                                                  ignore_eos=True))
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1
    assert all(len(o.token_ids) == 20 for o in out.outputs)
    assert_no_leaks(engine)


def pressure_prompts():
    """32 prompts: four families sharing 40-token prefixes, each with its own tail."""
    return [tokens(40, seed=10 + i % 4) + tokens(5 + i % 7, seed=100 + i) for i in range(32)]


@pytest.fixture(scope="module")
def unconstrained(model_dir):
    engine = engine_for(model_dir, **{"engine.max_num_seqs": 32, "engine.block_size": 8})
    outs = engine.generate(pressure_prompts(), greedy(max_tokens=24))
    assert engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode, swap_blocks", [("recompute", None), ("swap", 1024),
                                               ("swap", 12)])
def test_32_requests_in_a_few_dozen_blocks_match_an_unconstrained_run(
        model_dir, unconstrained, mode, swap_blocks):
    settings = {"engine.num_kv_blocks": 30, "engine.block_size": 8,
                "engine.max_num_seqs": 32, "engine.preemption": mode}
    if swap_blocks:
        settings["engine.num_swap_blocks"] = swap_blocks
    engine = engine_for(model_dir, **settings)
    schedule, events = engine.scheduler.schedule, {"swap_out": 0, "swap_in": 0, "recompute": 0}

    def observed(*args, **kw):
        out = schedule(*args, **kw)
        events["host_blocks"] = max(events.get("host_blocks", 0), engine.num_host_blocks_in_use)
        events["swap_out"] += len(out.swap_out)
        events["swap_in"] += len(out.swap_in)
        events["recompute"] += sum(s.status is SequenceStatus.WAITING for s in out.preempted)
        return out

    engine.scheduler.schedule = observed
    outs = engine.generate(pressure_prompts(), greedy(max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == unconstrained
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert events["swap_out"] > 0 and events["swap_in"] == events["swap_out"]
        assert events["host_blocks"] > 0  # what /metrics reports as host KV blocks in use
    assert (events["recompute"] > 0) == (mode == "recompute" or swap_blocks == 12)
    assert_no_leaks(engine)
