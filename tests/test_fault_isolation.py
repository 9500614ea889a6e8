"""Faults below the engine (tests/fault_plugin.py): a family that raises, or returns NaN
logits, fails only the requests it touches; everything they held (KV blocks, state slots,
adapter references) is released and the engine goes on serving. So does a fault in one
request's beam search."""

from __future__ import annotations

import json

import pytest

from heron.core import Engine, SamplingParams
from tests.engine_utils import assert_no_leaks, engine_config, run_to_end
from tests.fault_plugin import ALLOC, NAN, RAISE, plugins
from tests.hybrid_models import build_hybrid
from tests.lora_models import build_adapter
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PLAIN = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    base = build_tiny("llama", path, std=0.15)
    build_adapter(base, path / "adapter", r=4, alpha=8, targets=("q_proj", "v_proj"))
    return path


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def scheduling(request) -> dict:
    """Each test with and without async scheduling, where a fault may strike while the
    previous step's tokens are in flight."""
    return {"engine.async_scheduling": request.param}


@pytest.fixture
def make(scheduling):
    def make(path, **overrides) -> Engine:
        config = engine_config(path, **{"model.family": "faulty", **scheduling, **overrides})
        return Engine(config, plugins())
    return make


def run_all(engine: Engine, requests: dict[str, tuple[list[int], dict]]) -> dict:
    """Add every request, step to the end; the final output of each."""
    for rid, (prompt, kw) in requests.items():
        engine.add_request(rid, prompt, GREEDY, **kw)
    return run_to_end(engine)


def finish(out) -> tuple[str, str | None]:
    (o,) = out.outputs
    return o.finish_reason, o.error


def test_a_raising_step_fails_its_requests_and_spares_the_waiting_ones(llama, make):
    engine = make(llama, **{"engine.max_num_seqs": 2})
    done = run_all(engine, {"a": (PLAIN, {}), "bad": ([RAISE, RAISE, 5, 6], {}),
                            "waiting": (PLAIN, {})})
    assert finish(done["a"])[0] == finish(done["bad"])[0] == "error"  # both in the step
    assert "injected fault in forward" in finish(done["bad"])[1]
    assert finish(done["waiting"]) == ("length", None)  # not scheduled with them
    assert_no_leaks(engine)
    again = run_all(engine, {"after": (PLAIN, {})})  # the engine goes on serving
    assert finish(again["after"]) == ("length", None)
    assert again["after"].outputs[0].token_ids == done["waiting"].outputs[0].token_ids


def test_nan_logits_fail_only_their_request(llama, make):
    engine = make(llama)
    done = run_all(engine, {"a": (PLAIN, {}), "nan": ([NAN, NAN, 5, 6], {}),
                            "b": (PLAIN[:4], {})})
    assert finish(done["nan"]) == ("error", "the model produced non-finite logits")
    assert done["nan"].outputs[0].token_ids == []  # no garbage token was sampled
    assert finish(done["a"]) == finish(done["b"]) == ("length", None)
    assert_no_leaks(engine)


def test_a_fault_releases_adapter_references(llama, make):
    engine = make(llama, **{"lora.adapters": {"qv": str(llama / "adapter")}})
    engine.add_request("lora", PLAIN, GREEDY, adapter="qv")
    engine.step()  # prefill: the adapter is referenced now
    assert engine.num_adapters_in_use == 1
    done = run_all(engine, {"bad": ([RAISE, RAISE, 5], {"adapter": "qv"})})
    assert finish(done["bad"])[0] == "error"
    assert engine.num_adapters_in_use == 0 and engine.num_requests == 0
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("bamba")
    build_hybrid("bamba", path)
    return path


@pytest.mark.parametrize("mark", [RAISE, ALLOC, NAN])
def test_faults_release_state_slots_of_a_hybrid(hybrid, make, mark):
    engine = make(hybrid, **{"engine.max_num_seqs": 3})
    done = run_all(engine, {"a": (PLAIN, {}), "bad": ([mark, mark, 5, 6, 7], {}),
                            "b": (PLAIN[:5], {})})
    assert finish(done["bad"])[0] == "error"
    if mark == NAN:
        assert finish(done["a"]) == finish(done["b"]) == ("length", None)
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)
    assert finish(run_all(engine, {"after": (PLAIN, {})})["after"]) == ("length", None)


# -- through the server -----------------------------------------------------------------------

def test_marked_requests_get_500s_and_stream_errors_while_others_are_served(llama, scheduling):
    config = server_config(llama, **{"model.family": "faulty",
                                     "server.served_model_name": "tiny", **scheduling})
    engine = Engine(config, plugins())
    with ServerThread(config, engine) as server:
        for mark, message in ((RAISE, "injected fault in forward"),
                              (NAN, "non-finite logits")):
            body = {"model": "tiny", "prompt": [mark, mark, 5, 6], "max_tokens": 4}
            status, _, raw = server.http("POST", "/v1/completions", body)
            error = json.loads(raw)["error"]
            assert status == 500 and message in error["message"]
            assert error["type"] == "server_error"
            status, _, raw = server.http("POST", "/v1/completions", {**body, "stream": True})
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert status == 200 and message in json.loads(events[-2])["error"]["message"]
            assert events[-1] == "[DONE]"
            ok = server.client().completions.create(model="tiny", prompt=PLAIN, max_tokens=3,
                                                    extra_body={"ignore_eos": True})
            assert ok.choices[0].finish_reason == "length"
        metrics = server.wait_for(lambda m: m["heron_requests_running"] == 0)
        assert metrics["heron_kv_blocks_in_use"] == metrics["heron_requests_waiting"] == 0
        assert metrics["heron_state_slots_in_use"] == metrics["heron_lora_adapters_in_use"] == 0


def test_a_failing_beam_search_fails_only_its_request(llama, make):
    """One request's beam search raises from its third step on, while another request's
    search steps in the same batch: the faulty request ends with the error, the other beam
    search and a sampled request finish as they do without the fault, nothing leaks."""
    beams = SamplingParams(num_beams=3, n=2, max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(fault: bool) -> dict:
        engine = make(llama)
        engine.add_request("beams", PLAIN, beams)
        engine.add_request("bad", [5, 6, 7, 8], beams)
        engine.add_request("plain", PLAIN[:5], GREEDY)
        search, steps = engine._requests["bad"].beam.search, []
        real = search._process

        def process(logprobs):  # once per step of this search (and per try of it)
            steps.append(len(steps))
            if fault and len(steps) >= 3:
                raise RuntimeError("injected")
            real(logprobs)

        search._process = process
        done = run_to_end(engine)
        assert_no_leaks(engine)
        return done, len(steps)

    (ref, ref_steps), (got, got_steps) = run(False), run(True)
    assert ref_steps == 6 and got_steps == 4  # the batched try, then the search alone
    assert [(o.finish_reason, o.error) for o in got["bad"].outputs] == [
        ("error", "beam search step failed: injected")] * 2
    for rid in ("beams", "plain"):
        assert [o.token_ids for o in got[rid].outputs] == [o.token_ids for o in ref[rid].outputs]
        assert all(o.error is None for o in got[rid].outputs)
