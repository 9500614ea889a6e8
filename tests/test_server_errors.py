"""Errors: OpenAI's shape and the right 4xx for each malformed request, API keys, body limits."""

from __future__ import annotations

import importlib.metadata
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

KEYS = ["sk-test-one", "sk-test-two"]
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-errors")
    build_tiny("llama", path)
    config = server_config(path, **{"server.api_keys": KEYS, "server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as s:
        yield s


def cmpl(**kw):
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **kw}


# (method, path, body, status, param the error must name, or None)
MALFORMED = [
    # not JSON, or not an object
    ("POST", CMPL, b"{", 400, None),
    ("POST", CMPL, b"not json", 400, None),
    ("POST", CMPL, b"", 400, None),
    ("POST", CMPL, b"[1, 2]", 400, None),
    ("POST", CHAT, b'{"messages": [}', 400, None),
    # wrong types
    ("POST", CMPL, cmpl(prompt=5), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt={"a": 1}), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[1, "a"]), 400, "prompt"),
    ("POST", CMPL, cmpl(max_tokens="ten"), 400, "max_tokens"),
    ("POST", CMPL, cmpl(temperature="hot"), 400, "temperature"),
    ("POST", CMPL, cmpl(n=1.5), 400, "n"),
    ("POST", CMPL, cmpl(stream="yes"), 400, "stream"),
    ("POST", CMPL, cmpl(stop=5), 400, "stop"),
    ("POST", CMPL, cmpl(echo=1), 400, "echo"),
    ("POST", CMPL, cmpl(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("POST", CMPL, cmpl(num_beams=2, length_penalty=400.0), 400, "length_penalty"),
    ("POST", CHAT, chat(use_beam_search=True, n=2, length_penalty=-1e308), 400,
     "length_penalty"),
    ("POST", CHAT, chat(prompt_logprobs=True, stream=True), 400, "prompt_logprobs"),
    ("POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("POST", CHAT, chat(logprobs=3), 400, "logprobs"),
    ("POST", CHAT, chat(seed="x"), 400, "seed"),
    ("POST", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("POST", CMPL, cmpl(stream_options={"include_usage": True}, stream=False), 400,
     "stream_options"),
    # out of range
    ("POST", CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
    ("POST", CHAT, chat(thinking_token_budget=-1), 400, "thinking_token_budget"),
    ("POST", CHAT, chat(thinking_token_budget=4), 400, "thinking_token_budget"),  # no parser
    ("POST", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("POST", CMPL, cmpl(temperature=-0.5), 400, "temperature"),
    ("POST", CMPL, cmpl(temperature=3), 400, "temperature"),
    ("POST", CMPL, cmpl(top_p=0), 400, "top_p"),
    ("POST", CMPL, cmpl(n=0), 400, "n"),
    ("POST", CMPL, cmpl(n=1000), 400, "n"),
    ("POST", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    ("POST", CMPL, cmpl(presence_penalty=3), 400, "presence_penalty"),
    ("POST", CMPL, cmpl(top_k=-2), 400, "top_k"),
    ("POST", CMPL, cmpl(min_p=1.5), 400, "min_p"),
    ("POST", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    ("POST", CMPL, cmpl(seed=2**63), 400, "seed"),
    ("POST", CMPL, cmpl(min_tokens=9, max_tokens=4), 400, "min_tokens"),
    ("POST", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    ("POST", CMPL, cmpl(logit_bias={"5": 101}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"five": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={" 5": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"5_0": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"\u0665": 1}), 400, "logit_bias"),  # Arabic-Indic 5
    ("POST", CMPL, cmpl(logit_bias={"5": 1, "05": 2}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("POST", CHAT, chat(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(prompt=[99999]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("POST", CHAT, chat(messages=[]), 400, "messages"),
    ("POST", CHAT, chat(top_logprobs=30, logprobs=True), 400, "top_logprobs"),
    ("POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    # too long for the context (512 tokens)
    ("POST", CMPL, cmpl(prompt=[5] * 600), 400, "prompt"),
    ("POST", CMPL, cmpl(max_tokens=600), 400, "max_tokens"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": "fox " * 600}]), 400, "messages"),
    # unsupported features say so
    ("POST", CMPL, cmpl(suffix="tail"), 400, "suffix"),
    ("POST", CMPL, cmpl(best_of=3), 400, "best_of"),
    ("POST", CMPL, cmpl(best_of=0), 400, "best_of"),
    ("POST", CMPL, cmpl(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("POST", CMPL, cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("POST", CMPL, cmpl(frobnicate=True), 400, "frobnicate"),
    # a priority needs engine.scheduling_policy = "priority"
    ("POST", CMPL, cmpl(priority=-1), 400, "priority"),
    ("POST", CHAT, chat(priority=2), 400, "priority"),
    # tools: "auto" needs a parser this server lacks
    ("POST", CHAT, chat(tools=[TOOL]), 400, "tool_choice"),
    ("POST", CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice"),
    ("POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("POST", CHAT, chat(tools=[TOOL, TOOL], tool_choice="required"), 400, "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}],
                        tool_choice="required"), 400, "tools[0].function.name"),
    ("POST", CHAT, chat(tools=[TOOL], tool_choice="required",
                        response_format={"type": "json_object"}), 400, "tool_choice"),
    ("POST", CHAT, chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("POST", CMPL, cmpl(response_format={"type": "json_object"},
                        structured_outputs={"regex": "a"}), 400, "structured_outputs"),
    ("POST", CMPL, cmpl(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
     "structured_outputs"),
    ("POST", CMPL, cmpl(structured_outputs={}), 400, "structured_outputs"),
    ("POST", CMPL, cmpl(structured_outputs={"json": {}, "json_object": True}), 400,
     "structured_outputs"),
    ("POST", CMPL, cmpl(structured_outputs={"choice": []}), 400, "structured_outputs.choice"),
    ("POST", CMPL, cmpl(structured_outputs={"regex": "("}), 400, "structured_outputs.regex"),
    ("POST", CHAT, chat(response_format={"type": "json_schema",
                                         "json_schema": {"schema": {"type": "bogus"}}}), 400,
     "response_format.json_schema.schema"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     "messages[0].content[0].type"),
    ("POST", CHAT, chat(messages=[{"role": "function", "content": "42", "name": "f"}]), 400,
     "messages[0].role"),
    ("POST", CHAT, chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs"),
    ("POST", CHAT, chat(chat_template_kwargs={"continue_final_message": True}), 400,
     "chat_template_kwargs"),
    ("POST", CHAT, chat(tools=[TOOL], tool_choice="required",
                        chat_template_kwargs={"tools": []}), 400, "chat_template_kwargs"),
    ("POST", CHAT, chat(chat_template_kwargs={"namespace": "x"}), 400, "chat_template_kwargs"),
    # unknown model, route or method
    ("POST", CMPL, cmpl(model="gpt-4"), 404, "model"),
    ("POST", CHAT, chat(model="gpt-4"), 404, "model"),
    ("POST", "/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("GET", CMPL, None, 405, None),
    ("POST", "/tokenize", {"prompt": "x", "messages": USER}, 400, "prompt"),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("POST", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
]


def assert_error_shape(status: int, body: bytes, expected_status: int, param: str | None):
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_malformed_requests_fail_alone_while_a_stream_completes(server):
    assert len(MALFORMED) >= 50
    client = server.client(api_key=KEYS[0])
    args = dict(model="tiny", prompt="The quick brown fox", max_tokens=480, temperature=0.0,
                n=4, extra_body={"ignore_eos": True})
    expected = [c.text for c in client.completions.create(**args).choices]
    first_chunk, streamed = threading.Event(), []

    def stream():
        for chunk in client.completions.create(stream=True, **args):
            streamed.append((time.monotonic(), chunk))
            first_chunk.set()

    def send(case):
        answer = server.http(case[0], case[1], case[2], AUTH)
        return time.monotonic(), answer

    runner = threading.Thread(target=stream)
    runner.start()
    assert first_chunk.wait(60)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, MALFORMED))
    runner.join(120)
    for (method, path, body, status, param), (_, (got, _, answer)) in zip(MALFORMED, results):
        assert_error_shape(got, answer, status, param)
    texts = ["".join(c.text for _, chunk in streamed for c in chunk.choices if c.index == i)
             for i in range(4)]
    assert texts == expected
    reasons = {c.index: c.finish_reason for _, chunk in streamed for c in chunk.choices
               if c.finish_reason}
    assert reasons == dict.fromkeys(range(4), "length")
    stream_end = streamed[-1][0]
    answered_during_stream = sum(done < stream_end for done, _ in results)
    assert answered_during_stream >= len(MALFORMED) // 2  # they really ran side by side


def test_openai_client_sees_typed_errors(server):
    client = server.client(api_key=KEYS[0])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, suffix="y")
    assert e.value.body["param"] == "suffix" and "suffix" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=USER)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=600)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # named as sent
        client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=600)
    assert e.value.body["param"] == "max_completion_tokens"
    assert "`max_completion_tokens` (600)" in e.value.message


def test_body_over_the_limit_is_413(server):
    status, _, body = server.http("POST", CMPL, cmpl(prompt="a" * 70_000), AUTH)
    assert_error_shape(status, body, 413, None)


def test_api_keys(server):
    assert server.http("GET", "/health")[0] == 200
    status, _, body = server.http("GET", "/version")  # open, as /health
    assert status == 200 and json.loads(body)["version"] == importlib.metadata.version("heron")
    assert server.http("GET", "/metrics")[0] == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"}):
        status, got, body = server.http("POST", CMPL, cmpl(), headers)
        assert_error_shape(status, body, 401, None)
        assert got["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").models.list()
    for key in KEYS:
        assert server.client(api_key=key).models.list().data[0].id == "tiny"
    assert all(key not in repr(server.config) for key in KEYS)
