"""The prefix cache as clients see it, through a real server and the `openai` client:
``cached_tokens``, isolation by ``cache_salt`` and by API key, and /metrics."""

from __future__ import annotations

import json
import uuid

import pytest

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

SYSTEM = ("You are the help desk of a small library. Opening hours are nine to five on weekdays "
          "and ten to two on Saturdays. Members may borrow six books at a time for three weeks. ")
KEYS = ["sk-tenant-one", "sk-tenant-two"]
BS = 8  # conf/test.toml


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prefix")
    build_tiny("llama", path, std=0.15)
    return Engine(server_config(path, **{"server.served_model_name": "tiny"}))


@pytest.fixture
def server(engine):
    with ServerThread(engine.config, engine) as s:
        yield s


def chat(client, question, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                          temperature=0.0, **kw)


def prompt_ids(engine, question):
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tokenize=True)


def cached(response):
    return response.usage.prompt_tokens_details.cached_tokens


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_shared_system_prompt_is_reused_and_reported(server, engine):
    client, salt = server.client(), {"cache_salt": uuid.uuid4().hex}
    first = chat(client, "When do you open?", extra_body=salt)
    assert cached(first) == 0  # present, and zero on a cold cache
    second = chat(client, "How many books may I borrow?", extra_body=salt)
    shared = common_prefix(prompt_ids(engine, "When do you open?"),
                           prompt_ids(engine, "How many books may I borrow?"))
    assert cached(second) == shared // BS * BS > 0
    chunks = list(chat(client, "How many books may I borrow?", stream=True,
                       stream_options={"include_usage": True}, extra_body=salt))
    whole = second.usage.prompt_tokens
    assert cached(chunks[-1]) == (whole - 1) // BS * BS  # the same prompt again: all but the last


def test_cache_salts_are_separate_namespaces(server):
    client = server.client()
    salt_a, salt_b = uuid.uuid4().hex, uuid.uuid4().hex
    question = "Can I renew a book online?"
    assert cached(chat(client, question, extra_body={"cache_salt": salt_a})) == 0
    assert cached(chat(client, question, extra_body={"cache_salt": salt_a})) > 0
    assert cached(chat(client, question, extra_body={"cache_salt": salt_b})) == 0
    status, _, body = server.http("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "cache_salt": ""})
    assert status == 400 and json.loads(body)["error"]["param"] == "cache_salt"


def test_api_keys_are_separate_namespaces(engine):
    config = server_config(engine.config.model.path,
                           **{"server.served_model_name": "tiny", "server.api_keys": KEYS})
    with ServerThread(config, engine) as server:
        one, two = (server.client(api_key=k) for k in KEYS)
        question = "Do you lend films?"
        assert cached(chat(one, question)) == 0
        assert cached(chat(one, question)) > 0
        assert cached(chat(two, question)) == 0
        assert cached(chat(two, question, extra_body={"cache_salt": "x"})) == 0
    tenants = {engine.prefix_cache.namespace_of(b).tenant for b in range(engine.num_kv_blocks)
               if engine.prefix_cache.namespace_of(b) is not None}
    assert not any(key in tenant for key in KEYS for tenant in tenants)  # digests, not keys


def test_metrics_count_queried_and_hit_tokens(server):
    client, salt = server.client(), {"cache_salt": uuid.uuid4().hex}
    before = server.metrics()
    responses = [chat(client, "Where is the reading room?", extra_body=salt) for _ in range(2)]
    after = server.wait_for(lambda m: m["heron_requests_running"] == 0)
    delta = {k: after[k] - before[k] for k in ("heron_prefix_cache_queried_tokens_total",
                                               "heron_prefix_cache_hit_tokens_total")}
    assert delta["heron_prefix_cache_queried_tokens_total"] == sum(
        r.usage.prompt_tokens for r in responses)
    assert delta["heron_prefix_cache_hit_tokens_total"] == sum(map(cached, responses)) > 0
    assert after["heron_kv_blocks_cached"] > 0 and after["heron_kv_blocks_in_use"] == 0
