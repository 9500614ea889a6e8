"""Prefix caching for hybrid (SSM + attention) models: a hit restores KV blocks and a state
snapshot at the same token, and must give exactly what computing from scratch gives."""

from __future__ import annotations

import random

import pytest
import torch

from heron.core.sampling_params import SamplingParams
from tests.engine_utils import make_engine, run_one
from tests.hybrid_models import HYBRIDS, build_hybrid

BS = 8
VOCAB = 320


@pytest.fixture(scope="module", params=list(HYBRIDS))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_hybrid(request.param, path)
    return path


def engine_for(model_dir, **overrides):
    return make_engine(model_dir, **{"engine.block_size": BS, "engine.max_num_batched_tokens": 64,
                                     "engine.num_kv_blocks": 256, **overrides})


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy(max_tokens=16):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)


def run(engine, prompt, params=None, **kw):
    return run_one(engine, prompt, params or greedy(), **kw)


def assert_same(out, ref):
    """Same tokens, and the same top-5 logprobs at every generated position."""
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert torch.allclose(torch.tensor([v for _, v in a.top]),
                              torch.tensor([v for _, v in b.top]), atol=1e-4, rtol=1e-4)


def assert_idle(engine):
    states, cache = engine.states, engine.prefix_cache
    assert engine.num_blocks_in_use == 0 and not engine.has_unfinished()
    assert states.slots.num_used == 0 and states.num_pending == 0
    cached = cache.num_cached_snapshots if cache is not None else 0
    assert engine.num_state_snapshots == cached  # what /metrics reports


@pytest.fixture(scope="module")
def cold(model_dir):
    return engine_for(model_dir, **{"prefix_cache.enabled": False})


@pytest.mark.parametrize("admission", ["marconi", "every_block"])
def test_a_follow_up_turn_resumes_from_the_last_snapshot(model_dir, cold, admission):
    engine = engine_for(model_dir, **{"prefix_cache.snapshot_admission": admission})
    turn1 = tokens(45, seed=1)
    answer = run(engine, turn1).outputs[0].token_ids
    turn2 = turn1 + answer + tokens(11, seed=2)
    out = run(engine, turn2)
    written = len(turn1) + len(answer) - 1  # the last answer token was never computed
    if not engine.runner.generated_matches_prompt:  # NemotronH: prompts only are cached
        written = len(turn1)
    assert out.num_cached_tokens == written // BS * BS > 0
    assert_same(out, run(cold, turn2))
    assert_idle(engine)


def test_a_shared_prefix_is_snapshotted_where_prompts_branch(model_dir, cold):
    engine = engine_for(model_dir)
    shared = tokens(37, seed=3)
    first = run(engine, shared + tokens(9, seed=4))
    second = run(engine, shared + tokens(12, seed=5))  # branches off the cached path...
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    prompt = shared + tokens(7, seed=6)
    third = run(engine, prompt)  # ...where the second left a snapshot
    assert third.num_cached_tokens == len(shared) // BS * BS
    assert_same(third, run(cold, prompt))
    assert_idle(engine)


def test_tenants_never_restore_each_others_snapshots(model_dir):
    engine = engine_for(model_dir)
    restored = []
    restore = engine.states.restore
    engine.states.restore = lambda seq, snapshot: (restored.append((seq.namespace.tenant,
                                                                    snapshot)),
                                                   restore(seq, snapshot))
    turn1 = tokens(40, seed=7)
    answer = run(engine, turn1, tenant="a").outputs[0].token_ids
    follow = turn1 + answer + tokens(5, seed=8)
    assert run(engine, follow, tenant="b").num_cached_tokens == 0
    assert run(engine, follow, tenant="a").num_cached_tokens > 0
    assert [t for t, _ in restored] == ["a"]
    assert_idle(engine)


def test_tight_snapshot_and_kv_pools_stay_exact(model_dir, cold):
    engine = engine_for(model_dir, **{"prefix_cache.num_snapshots": 1,
                                      "engine.num_kv_blocks": 24})
    prompts = [tokens(30, seed=20 + i % 3) + tokens(4 + i, seed=40 + i) for i in range(6)]
    outs = engine.generate(prompts, greedy(max_tokens=20))
    refs = cold.generate(prompts, greedy(max_tokens=20))
    assert engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, refs):
        assert_same(out, ref)
    assert_idle(engine)
