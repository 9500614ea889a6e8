"""Tenants: API keys name them; their prefix-cache namespaces, metrics and logs stay apart,
keys are compared in constant time and appear in no log line, metric or error."""

from __future__ import annotations

import hmac
import re

import openai
import pytest

from heron.core import Engine
from heron.server import middleware
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

TENANTS = {"acme": ["sk-acme-one", "sk-acme-two"], "globex": ["sk-globex"]}
SOLO = "sk-solo-key"
KEYS = [SOLO, *TENANTS["acme"], *TENANTS["globex"]]
SECRET_PROMPT = "The acme merger closes on the ninth of March at a price of 41 dollars"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny("llama", path, std=0.15)
    config = server_config(path, **{"server.served_model_name": "tiny",
                                    "server.api_keys": [SOLO], "server.tenants": TENANTS})
    with ServerThread(config, Engine(config)) as s:
        yield s


def ask(server, key, prompt=SECRET_PROMPT):
    return server.client(api_key=key).completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0.0)


def cached(response):
    return response.usage.prompt_tokens_details.cached_tokens


def test_keys_of_one_tenant_share_its_cache_and_no_one_else_does(server):
    prompt = SECRET_PROMPT + " (cache)"
    assert cached(ask(server, "sk-acme-one", prompt)) == 0
    assert cached(ask(server, "sk-acme-two", prompt)) > 0  # same tenant
    assert cached(ask(server, "sk-globex", prompt)) == 0
    assert cached(ask(server, SOLO, prompt)) == 0
    with pytest.raises(openai.AuthenticationError):
        ask(server, "sk-acme-three", prompt)


def test_metrics_count_by_tenant_and_show_no_keys_or_prompts(server):
    before = server.metrics()
    for key in ("sk-acme-one", "sk-acme-two", "sk-globex"):
        ask(server, key)
    after = server.wait_for(lambda m: m["heron_requests_running"] == 0)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    finished = 'heron_tenant_requests_finished_total{{finish_reason="length",tenant="{}"}}'
    assert delta(finished.format("acme")) == 2 and delta(finished.format("globex")) == 1
    tokens = 'heron_tenant_tokens_total{{kind="prompt",tenant="{}"}}'
    assert delta(tokens.format("acme")) == 2 * delta(tokens.format("globex")) > 0
    ask(server, SOLO)  # an `api_keys` key: a tenant named by its place in the list
    solo = server.wait_for(lambda m: m.get(finished.format("api_keys[0]"), 0) >= 1)
    assert solo[finished.format("api_keys[0]")] >= 1
    _, _, body = server.http("GET", "/metrics")
    text = body.decode()
    assert not any(key in text for key in KEYS) and "merger" not in text


def test_logs_name_tenants_never_keys_or_prompts(server, capfd):
    capfd.readouterr()
    for key in KEYS:
        ask(server, key)
    status, _, body = server.http("POST", "/v1/completions", {"model": "tiny", "prompt": "x"},
                                  headers={"Authorization": "Bearer sk-wrong-key"})
    assert status == 401 and b"sk-wrong-key" not in body
    out = capfd.readouterr()
    logs = out.out + out.err
    assert not any(key in logs for key in [*KEYS, "sk-wrong-key"])
    assert "merger" not in logs
    tenants = [m.group(1) for m in re.finditer(r"\[info\s*\] request .* tenant=(\S+)", logs)]
    assert sorted(tenants) == sorted(["acme", "acme", "globex", "api_keys[0]"])


def test_keys_are_compared_against_every_key_in_constant_time(server, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(len(b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", counting)
    for key in (KEYS[0], KEYS[-1], "sk-nope"):
        calls.clear()
        status, _, _ = server.http("GET", "/v1/models",
                                   headers={"Authorization": f"Bearer {key}"})
        assert status == (401 if key == "sk-nope" else 200)
        assert len(calls) == len(KEYS)  # no early exit on a match


def test_tenant_config_is_checked_and_hidden():
    from heron.core.config import ConfigError, dump_config, load_config
    with pytest.raises(ConfigError, match="must not repeat a key"):
        load_config(None, {"server.api_keys": ["sk-a"], "server.tenants": {"t": ["sk-a"]}})
    with pytest.raises(ConfigError, match="names must be"):
        load_config(None, {"server.tenants": {"a|b": ["sk-b"]}})
    config = load_config(None, {"server.tenants": TENANTS})
    assert "sk-acme" not in dump_config(config) and "sk-acme" not in repr(config)
