"""The asyncio driver on its own: deltas, aborts between steps, backpressure, faults, stop."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from heron.core.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from heron.core.sampling_params import SamplingParams, StructuredOutput
from tests.engine_utils import engine_config, make_engine
from tests.tiny_models import build_tiny

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-async")
    build_tiny("llama", path)
    return make_engine(path, **{"engine.block_size": 8, "engine.num_kv_blocks": 256})


def collect(queue: asyncio.Queue):
    async def until_finished():
        deltas = []
        while not deltas or not deltas[-1].finished:
            deltas.append(await asyncio.wait_for(queue.get(), 60))
        return deltas
    return until_finished()


def run(engine, body, **kw):
    async def main():
        driver = AsyncEngine(engine, **kw)
        driver.start()
        try:
            return await body(driver)
        finally:
            await driver.stop()
            assert driver.stats.num_kv_blocks_in_use == 0
    result = asyncio.run(main())
    assert engine.num_blocks_in_use == 0 and not engine.has_unfinished()
    return result


def test_deltas_add_up_to_the_offline_result(engine):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1, n=2)
    expected = engine.generate(["The quick"], params)[0].outputs

    async def body(driver):
        queue = asyncio.Queue()
        await driver.add("a", engine.tokenizer.encode("The quick"), params, queue.put_nowait)
        return await collect(queue)

    deltas = run(engine, body)
    for index in range(2):
        seqs = [s for d in deltas for s in d.seqs if s.index == index]
        assert [t for s in seqs for t in s.token_ids] == expected[index].token_ids
        assert "".join(s.text for s in seqs) == expected[index].text
        assert sum(len(s.logprobs) for s in seqs) == 20
        assert [s.finish_reason for s in seqs][-1] == "length"
    assert all(d.time_s > 0 for d in deltas)


def test_abort_takes_effect_before_the_next_step(engine):
    async def body(driver):
        queue = asyncio.Queue()
        await driver.add("a", [5, 6, 7], LONG, queue.put_nowait)
        first = await queue.get()
        steps = []
        real_step = engine.step
        engine.step = lambda: steps.append(1) or real_step()  # counts steps from now on
        try:
            driver.abort("a")
            rest = await collect(queue)
        finally:
            del engine.step
        return first, rest, steps

    first, rest, steps = run(engine, body)
    assert first.seqs[0].token_ids and rest[-1].seqs[0].finish_reason == "abort"
    assert len(steps) <= 1  # at most the step already in flight when abort was called
    assert sum(len(s.token_ids) for d in rest for s in d.seqs) <= 1


def test_grammars_compile_off_the_loop_while_steps_go_on(engine):
    """A slow compile (stood in for by a sleep around the real one) runs in a thread of its
    own: the running request keeps getting tokens meanwhile, and the guided one still
    matches its regex, as offline."""
    guided = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutput(regex=r"[a-z]{2,5}-[0-9]{1,3}"))
    expected = engine.generate(["The quick"], guided)[0].outputs[0]
    compiles = []
    real_compile = engine.compile_grammar

    def slow_compile(params):
        if params.structured_outputs is None:
            return real_compile(params)
        start = time.monotonic()
        time.sleep(0.5)
        compiles.append((threading.current_thread(), start, time.monotonic()))
        return real_compile(params)

    async def body(driver):
        running, queue = asyncio.Queue(), asyncio.Queue()
        await driver.add("a", [5, 6, 7], LONG, running.put_nowait)
        await running.get()
        await driver.add("g", engine.tokenizer.encode("The quick"), guided, queue.put_nowait)
        arrivals = []
        while not running.empty():
            arrivals.append(running.get_nowait().time_s)
        driver.abort("a")
        return arrivals, await collect(queue)

    engine.compile_grammar = slow_compile
    try:
        arrivals, deltas = run(engine, body)
    finally:
        del engine.compile_grammar
    [(thread, start, end)] = compiles
    assert thread is not threading.main_thread()
    assert sum(start < t < end for t in arrivals) >= 3  # steps went on during the compile
    seqs = [s for d in deltas for s in d.seqs]
    text = "".join(s.text for s in seqs)
    assert text == expected.text and re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text)
    assert seqs[-1].finish_reason == "stop"


def test_waiting_limit_and_engine_refusals(engine):
    async def body(driver):
        queue = asyncio.Queue()
        with pytest.raises(ValueError, match="context"):
            await driver.add("long", [5] * 600, LONG, queue.put_nowait)
        # tasks start in order, before the engine task wakes: two wait, the third is refused
        results = await asyncio.gather(
            *(driver.add(f"r{i}", [5, 6], LONG, queue.put_nowait) for i in range(3)),
            return_exceptions=True)
        assert results[:2] == [None, None] and isinstance(results[2], QueueFullError)
        with pytest.raises(ValueError, match="already in use"):
            await driver.add("r0", [5], LONG, queue.put_nowait)
        for i in range(2):
            driver.abort(f"r{i}")

    run(engine, body, max_waiting_requests=2)


def test_a_step_that_raises_fails_what_is_in_flight_and_the_engine_goes_on(engine):
    async def body(driver):
        queue = asyncio.Queue()
        real_step, calls = engine.step, []

        def failing_once():
            calls.append(threading.current_thread().name)
            if len(calls) == 2:
                raise RuntimeError("bug")
            return real_step()

        engine.step = failing_once
        try:
            await driver.add("a", [5, 6, 7], LONG, queue.put_nowait)
            failed = await collect(queue)
        finally:
            del engine.step
        await driver.add("b", [5, 6, 7], SamplingParams(max_tokens=3), queue.put_nowait)
        return failed, await collect(queue), calls

    failed, ok, calls = run(engine, body)
    assert failed[-1].seqs[0].finish_reason == "error"
    assert ok[-1].seqs[0].finish_reason == "length"
    assert all(name.startswith("heron-engine") for name in calls)  # steps run off the loop


def test_stop_finishes_every_request_and_refuses_new_ones(engine):
    async def body(driver):
        queue = asyncio.Queue()
        await driver.add("a", [5, 6, 7], LONG, queue.put_nowait)
        await queue.get()
        await driver.stop()
        rest = await collect(queue)
        with pytest.raises(EngineStoppedError):
            await driver.add("b", [5], LONG, queue.put_nowait)
        return rest

    rest = run(engine, body)
    assert rest[-1].finished and rest[-1].seqs[0].finish_reason == "abort"


def test_load_builds_the_engine_on_the_thread_that_steps_it(tmp_path, monkeypatch):
    # why: the threading contract in heron.core.async_engine (one OpenMP pool, not two)
    import heron.core.async_engine as async_engine

    build_tiny("llama", tmp_path)
    threads = {"stepped": set()}

    class Observed(async_engine.Engine):
        def __init__(self, config):
            threads["built"] = threading.get_ident()
            super().__init__(config)

        def step(self):
            threads["stepped"].add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(async_engine, "Engine", Observed)
    config = engine_config(tmp_path)

    async def main():
        driver = await AsyncEngine.load(config)
        driver.start()
        try:
            queue = asyncio.Queue()
            await driver.add("a", [5, 6, 7], SamplingParams(max_tokens=4), queue.put_nowait)
            return await collect(queue)
        finally:
            await driver.stop()

    deltas = asyncio.run(main())
    assert deltas[-1].seqs[0].finish_reason == "length"
    assert threads["built"] != threading.get_ident()
    assert threads["stepped"] == {threads["built"]}
