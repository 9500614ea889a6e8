"""Request limits and deadlines of ``[server]``: each refusal is a 4xx in OpenAI's shape that
names the field and the config key; requests at a limit pass; a timed-out request is aborted
in the engine and leaves it idle."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from heron.core.config import ConfigError
from heron.core.engine import Engine
from tests.engine_utils import eager_steps
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

LIMITS = {"server.max_n": 3, "server.max_logprobs": 4, "server.max_stop_sequences": 2,
          "server.max_stop_length": 8}
CONTEXT = 96  # model.max_model_len: small, so that running to the end of the context is quick
LONG = {"max_tokens": 64, "ignore_eos": True, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-limits")
    build_tiny("llama", path)
    return path


def config_for(model_dir, **overrides):
    return server_config(model_dir, **{"server.served_model_name": "tiny",
                                       "model.max_model_len": CONTEXT, **overrides})


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(config_for(model_dir))


@pytest.fixture(scope="module")
def server(model_dir, engine):
    with ServerThread(config_for(model_dir, **LIMITS), engine) as s:
        yield s


class SlowForward:
    """Every model step takes at least ``delay_s`` more (sleeping releases the GIL, as torch
    does while it computes), so that a tiny model's request outlives a short deadline."""

    def __init__(self, engine: Engine, delay_s: float) -> None:
        self.engine, self.real, self.delay_s = engine, eager_steps(engine).runner.forward, delay_s
        engine.runner.forward = self

    def __call__(self, batch):
        time.sleep(self.delay_s)
        return self.real(batch)

    def restore(self) -> None:
        self.engine.runner.forward = self.real


@pytest.fixture
def slow(engine):
    fault = SlowForward(engine, 0.05)
    yield fault
    fault.restore()


def idle(metrics):
    return (metrics["heron_requests_running"] == 0 and metrics["heron_requests_waiting"] == 0
            and metrics["heron_kv_blocks_in_use"] == 0)


def assert_idle(server, timeout_s: float = 30.0):
    assert idle(server.wait_for(idle, timeout_s=timeout_s))
    assert server.async_engine.num_requests == 0
    assert server.async_engine.engine.num_blocks_in_use == 0


def assert_error(body: bytes, status: int, param: str | None, key: str) -> dict:
    """``body`` is one OpenAI-shaped error naming ``param`` and the config key ``key``."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and f"(server.{key})" in error["message"], error
    assert error["type"] == {400: "invalid_request_error", 408: "timeout_error",
                             429: "rate_limit_error"}[status], error
    return error


def sse_events(body: bytes) -> list:
    return [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]


# -- per-request limits ---------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param, key", [
    ("/v1/completions", {"prompt": "hi", "n": 4}, "n", "max_n"),
    ("/v1/chat/completions", {**CHAT, "n": 4}, "n", "max_n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 5}, "logprobs", "max_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 5, "echo": True, "max_tokens": 0},
     "logprobs", "max_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 5}, "top_logprobs",
     "max_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop",
     "max_stop_sequences"),
    ("/v1/chat/completions", {**CHAT, "stop": "x" * 9}, "stop", "max_stop_length"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "x" * 9]}, "stop[1]",
     "max_stop_length"),
])
def test_past_a_limit_is_a_400_naming_field_and_key(server, path, body, param, key):
    status, _, raw = server.http("POST", path, {"model": "tiny", **body})
    assert status == 400, raw
    error = assert_error(raw, 400, param, key)
    assert error["code"] == "limit_exceeded"
    assert f"at most {LIMITS['server.' + key]}" in error["message"], error


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 4}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4}),
])
def test_at_every_limit_passes(server, path, body):
    status, _, raw = server.http("POST", path, {
        "model": "tiny", "n": 3, "stop": ["x" * 8, "y" * 8], "max_tokens": 3, **body})
    assert status == 200, raw
    assert len(json.loads(raw)["choices"]) == 3


def test_the_default_limits_apply_below_the_protocol_ceilings(model_dir, engine):
    with ServerThread(config_for(model_dir), engine) as s:
        status, _, raw = s.http("POST", "/v1/completions",
                                {"model": "tiny", "prompt": "hi", "n": 17})
        assert status == 400 and "at most 16 (server.max_n)" in raw.decode(), raw
        status, _, raw = s.http("POST", "/v1/completions",
                                {"model": "tiny", "prompt": "hi", "logprobs": 21})
        assert status == 400 and "at most 20 (server.max_logprobs)" in raw.decode(), raw
        status, _, raw = s.http("POST", "/v1/completions",  # past the hard ceiling
                                {"model": "tiny", "prompt": "hi", "n": 129})
        assert status == 400 and json.loads(raw)["error"]["param"] == "n", raw


@pytest.mark.parametrize("key, value", [
    ("max_n", 0), ("max_n", 129), ("max_logprobs", -1), ("max_logprobs", 1025),
    ("max_stop_sequences", -1), ("max_stop_length", 0), ("max_waiting_tokens", 0),
    ("request_timeout_s", 0), ("request_timeout_s", -1.5),
])
def test_bad_limits_are_config_errors(model_dir, key, value):
    with pytest.raises(ConfigError, match=key):
        config_for(model_dir, **{f"server.{key}": value})


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": None}),
])
def test_unset_max_tokens_stops_at_the_context(server, path, body):
    status, _, raw = server.http("POST", path, {
        "model": "tiny", "ignore_eos": True, "temperature": 0.0, **body})
    assert status == 200, raw
    out = json.loads(raw)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == CONTEXT, out["usage"]


# -- request_timeout_s ----------------------------------------------------------------------

@pytest.fixture
def timeout_server(model_dir, engine, slow):
    with ServerThread(config_for(model_dir, **{"server.request_timeout_s": 0.5}),
                      engine) as s:
        yield s


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/chat/completions", CHAT),
])
def test_a_request_past_its_deadline_is_aborted_with_a_408(timeout_server, path, body):
    start = time.monotonic()
    status, _, raw = timeout_server.http("POST", path, {"model": "tiny", **LONG, **body})
    assert status == 408, raw
    error = assert_error(raw, 408, None, "request_timeout_s")
    assert error["code"] == "request_timeout"
    assert time.monotonic() - start < 1.5  # 64 slow steps would take 3.2 s and more
    assert_idle(timeout_server, timeout_s=1.5)  # aborted: not 64 slow steps later


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/chat/completions", CHAT),
])
def test_a_stream_past_its_deadline_ends_with_an_error_event(timeout_server, path, body):
    status, _, raw = timeout_server.http("POST", path, {"model": "tiny", "stream": True,
                                                        **LONG, **body})
    assert status == 200, raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) >= 3, events  # some chunks came first
    assert_error(events[-2].encode(), 408, None, "request_timeout_s")
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert_idle(timeout_server, timeout_s=1.5)  # aborted: not 64 slow steps later


def test_the_openai_client_does_not_retry_a_timed_out_request(timeout_server):
    """The client retries a 408 by default, unless the answer says not to: the request that
    outlasted the limit runs once, not three times."""
    aborted = 'heron_requests_finished_total{finish_reason="abort"}'
    before = timeout_server.metrics().get(aborted, 0.0)
    client = timeout_server.client(max_retries=2)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model="tiny", prompt="The quick brown fox",
                                  max_tokens=64, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert raised.value.status_code == 408
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert time.monotonic() - start < 1.5  # one deadline, not three
    assert timeout_server.wait_for(lambda m: m.get(aborted, 0.0) > before)[aborted] == before + 1


def test_a_request_within_its_deadline_is_answered(model_dir, engine, slow):
    # four slow steps (0.2 s) against 5 s: room for a machine that stalls for a moment
    with ServerThread(config_for(model_dir, **{"server.request_timeout_s": 5.0}),
                      engine) as server:
        status, _, raw = server.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": "hi", "max_tokens": 3})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3


# -- max_waiting_tokens ---------------------------------------------------------------------

def test_waiting_prompt_tokens_past_the_limit_get_429(model_dir):
    prompt = list(range(10, 50))  # 40 tokens: two may wait (80 = the limit), not three
    config = config_for(model_dir, **{"server.max_waiting_tokens": 80,
                                      "engine.max_num_seqs": 1})
    engine = Engine(config)
    slow = SlowForward(engine, 0.02)
    body = {"model": "tiny", "prompt": prompt, **{**LONG, "max_tokens": 40}}
    with ServerThread(config, engine) as server:
        results = {}

        def call(name):
            results[name] = server.http("POST", "/v1/completions", body)

        workers = [threading.Thread(target=call, args=(name,)) for name in "abc"]
        workers[0].start()
        server.wait_for(lambda m: m["heron_requests_running"] == 1)
        for w in workers[1:]:
            w.start()
        busy = server.wait_for(lambda m: m["heron_requests_waiting"] == 2)
        assert busy["heron_requests_waiting"] == 2, busy
        status, headers, raw = server.http("POST", "/v1/completions", body)
        assert status == 429, raw
        error = assert_error(raw, 429, None, "max_waiting_tokens")
        assert error["code"] == "queue_full" and headers.get("Retry-After") == "1"
        for w in workers:
            w.join(60)
        for name, (status, _, raw) in results.items():
            assert status == 200, (name, raw)
            assert json.loads(raw)["usage"]["completion_tokens"] == 40
        assert_idle(server)
        assert server.async_engine.stats.num_prompt_tokens_waiting == 0
        # with nothing waiting, even a prompt larger than the limit is queued
        status, _, raw = server.http("POST", "/v1/completions", {
            **body, "prompt": list(range(10, 95)), "max_tokens": 2})
        assert status == 200, raw
    slow.restore()


# -- a KV cache smaller than the context ----------------------------------------------------

def test_a_kv_cache_below_the_context_is_flagged_and_named(model_dir, caplog):
    """4 blocks of 16 tokens under a context of 96: the start-up log says so, and a request
    that could outgrow the cache (no max_tokens: up to the context's end) is a 400 naming
    `max_tokens` and the room left, not a bare engine error."""
    config = config_for(model_dir, **{"engine.num_kv_blocks": 4, "engine.block_size": 16})
    engine = Engine(config)
    assert "the KV cache holds 64 tokens" in caplog.text
    with ServerThread(config, engine) as server:
        client = server.client()
        prompt = len(engine.tokenizer.apply_chat_template(CHAT["messages"], tokenize=True))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", **CHAT)
        assert e.value.body["param"] == "max_tokens"
        assert e.value.code == "context_length_exceeded"
        assert f"send `max_tokens` <= {64 - prompt}" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", max_completion_tokens=64, **CHAT)
        assert e.value.body["param"] == "max_completion_tokens"
        out = client.chat.completions.create(model="tiny", max_tokens=64 - prompt, **CHAT)
        assert out.usage.completion_tokens <= 64 - prompt


def test_a_call_that_could_never_wait_whole_is_a_400_not_a_429(model_dir, engine):
    """More prompts than may wait, or more tokens in all: a 429 would be retried for ever."""
    config = config_for(model_dir, **{"server.max_waiting_requests": 3,
                                      "server.max_waiting_tokens": 40})
    with ServerThread(config, engine) as server:
        for prompt, key in (([[5, 6]] * 4, "max_waiting_requests"),
                            ([[5] * 30, [6] * 30], "max_waiting_tokens")):
            status, _, raw = server.http("POST", "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert status == 400, raw
            assert assert_error(raw, 400, "prompt", key)["code"] == "limit_exceeded"
        # one prompt past max_waiting_tokens gets in when nothing waits, as always
        status, _, raw = server.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": [[5] * 50], "max_tokens": 2})
        assert status == 200, raw
