"""Under load: disconnects free everything, backpressure answers 429, faults stay contained,
and /health answers while a model step runs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from heron.core.engine import Engine
from tests.engine_utils import eager_steps
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

LONG = dict(model="tiny", prompt="The quick brown fox", max_tokens=450, temperature=0.0,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-load")
    build_tiny("llama", path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "engine.max_num_seqs": 32,
                                         "engine.num_kv_blocks": 2048,
                                         "engine.max_num_batched_tokens": 128})
    with ServerThread(config, Engine(config)) as s:
        yield s


class FaultyForward:
    """Wraps the family's forward (fault injection below the engine): ``fail`` raises in the
    next step, ``delay_s`` makes the next step that long (sleeping releases the GIL, as torch
    does while it computes)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.real = engine, eager_steps(engine).runner.forward
        self.fail, self.delay_s = threading.Event(), 0.0
        engine.runner.forward = self

    def __call__(self, batch):
        if self.fail.is_set():
            self.fail.clear()
            raise RuntimeError("injected fault")
        if self.delay_s:
            delay, self.delay_s = self.delay_s, 0.0
            time.sleep(delay)
        return self.real(batch)

    def restore(self) -> None:
        self.engine.runner.forward = self.real


@pytest.fixture
def faults(server):
    fault = FaultyForward(server.async_engine.engine)
    yield fault
    fault.restore()


def idle(metrics):
    return (metrics["heron_requests_running"] == 0 and metrics["heron_requests_waiting"] == 0
            and metrics["heron_kv_blocks_in_use"] == 0)


def test_dropped_streams_are_aborted_and_free_their_blocks(server):
    client = server.client()
    before = server.metrics()
    streams = []
    for _ in range(20):
        stream = client.completions.create(stream=True, **LONG)
        next(iter(stream))  # a first chunk arrived: the request runs
        streams.append(stream)
    busy = server.metrics()
    assert busy["heron_requests_running"] == 20 and busy["heron_kv_blocks_in_use"] > 0
    for stream in streams:
        stream.close()  # drops the connection mid-stream
    after = server.wait_for(idle, timeout_s=30)
    assert idle(after), after
    aborted = 'heron_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 20
    generated = (after["heron_generation_tokens_total"]
                 - before.get("heron_generation_tokens_total", 0))
    assert generated < 20 * LONG["max_tokens"] / 2  # stopped early, not run to the end
    # the server is still fine
    assert client.completions.create(**{**LONG, "max_tokens": 3}).usage.completion_tokens == 3


def test_health_answers_while_a_step_runs(server, faults):
    client = server.client()
    faults.delay_s = 2.0
    worker = threading.Thread(target=client.completions.create, kwargs={**LONG, "max_tokens": 2})
    worker.start()
    time.sleep(0.3)  # the slow step is under way
    latencies = []
    while worker.is_alive() and len(latencies) < 10:
        start = time.monotonic()
        assert server.http("GET", "/health")[0] == 200
        latencies.append(time.monotonic() - start)
    worker.join(60)
    assert latencies and max(latencies) < 1.0, latencies


def test_a_fault_fails_only_the_requests_it_touches(server, faults):
    client = server.client()
    stream = client.completions.create(stream=True, **LONG)
    chunks = iter(stream)
    next(chunks)
    faults.fail.set()
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in chunks:
            pass  # the stream ends with an error event, not a silent cut
    faults.fail.set()
    with pytest.raises(openai.InternalServerError):
        client.completions.create(**LONG)
    assert not faults.fail.is_set()
    ok = client.completions.create(**{**LONG, "max_tokens": 4})
    assert ok.choices[0].finish_reason == "length"
    assert idle(server.wait_for(idle))


def test_backpressure_answers_429_quickly_and_the_rest_complete(model_dir):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "server.max_waiting_requests": 2,
                                         "engine.max_num_seqs": 2})
    with ServerThread(config, Engine(config)) as server:
        client = server.client()

        def call(_):
            start = time.monotonic()
            try:
                out = client.completions.create(**{**LONG, "max_tokens": 100})
                return "ok", time.monotonic() - start, out
            except openai.RateLimitError as e:
                return "429", time.monotonic() - start, e

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(call, range(16)))
        ok = [r for r in results if r[0] == "ok"]
        rejected = [r for r in results if r[0] == "429"]
        assert len(ok) >= 2 and rejected, [r[:2] for r in results]
        assert all(r[2].usage.completion_tokens == 100 for r in ok)
        assert all(r[2].code == "queue_full" for r in rejected)
        assert max(r[1] for r in rejected) < max(r[1] for r in ok)
        after = server.wait_for(idle)
        assert idle(after)
        assert after['heron_requests_rejected_total{status="429"}'] == len(rejected)
