"""Priority scheduling on a real engine: a request of a better priority preempts a worse
one for its seat at once, and no output changes (greedy tokens, as each request alone)."""

from __future__ import annotations

import pytest

from heron.core.engine import Engine
from heron.core.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leaks, make_engine, run_one
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

PROMPTS = ["The quick brown fox", "Paged attention keeps", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-priority")
    build_tiny("llama", path)
    return path


def params(priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, priority=priority)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_better_priority_runs_at_once_and_outputs_do_not_change(model_dir, async_scheduling):
    solo = make_engine(model_dir)
    expected = [run_one(solo, p, params()).outputs[0].token_ids for p in PROMPTS]
    engine = make_engine(model_dir, **{"engine.scheduling_policy": "priority",
                                       "engine.max_num_seqs": 2, "engine.block_size": 8,
                                       "engine.async_scheduling": async_scheduling})
    engine.add_request("low0", PROMPTS[0], params(1))
    engine.add_request("low1", PROMPTS[1], params(2))
    for _ in range(5):
        engine.step()
    engine.add_request("high", PROMPTS[2], params(-1))
    engine.step()  # the worst running request gives its seat to high at once
    assert engine.scheduler.num_preemptions == 1
    assert {s.request_id for s in engine.scheduler.running} == {"low0", "high"}
    done = {}
    while engine.has_unfinished():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    assert [done[r].outputs[0].token_ids for r in ("low0", "low1", "high")] == expected
    assert_no_leaks(engine)
    with pytest.raises(ValueError, match="scheduling_policy"):
        solo.add_request("x", PROMPTS[0], params(1))


def test_the_server_takes_priority_with_the_policy(model_dir):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "engine.scheduling_policy": "priority"})
    with ServerThread(config, Engine(config)) as server:
        out = server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4,
                                                 extra_body={"priority": -5})
        assert out.choices[0].finish_reason == "length"
