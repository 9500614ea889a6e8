"""Multi-LoRA through a real server and the `openai` client: routing by ``model``, the
model list, vLLM's load/unload endpoints, the path restriction and every bad adapter."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from heron.core.engine import Engine
from heron.core.sampling_params import SamplingParams
from tests.lora_models import build_adapter
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

pytest.importorskip("peft")

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
QV = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The base model, the allowed adapter directory and one outside it, with adapters."""
    root = tmp_path_factory.mktemp("lora-server")
    base = build_tiny("llama", root / "base", std=0.15)
    allowed, outside = root / "allowed", root / "outside"
    build_adapter(base, allowed / "qv", r=8, alpha=16, targets=QV, seed=1)
    build_adapter(base, allowed / "mlp", r=4, alpha=8, targets=("gate_proj", "down_proj"),
                  seed=2)
    build_adapter(base, outside / "evil", r=8, alpha=16, targets=QV, seed=3)
    shutil.copytree(outside / "evil", root / "allowed-sibling" / "evil")
    return {"root": root, "base_model": base, "base": root / "base", "allowed": allowed,
            "outside": outside}


@pytest.fixture(scope="module")
def config(dirs):
    return server_config(dirs["base"], **{
        "server.served_model_name": "tiny", "server.api_keys": [KEY],
        "lora.adapters": {"sql": str(dirs["allowed"] / "qv")},
        "lora.allow_runtime_updates": True, "lora.allowed_dirs": [str(dirs["allowed"])],
        "lora.max_rank": 16, "lora.max_loras": 2})


@pytest.fixture(scope="module")
def server(config):
    with ServerThread(config, Engine(config)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


@pytest.fixture(scope="module")
def tokenizer_ids(server):
    return server.async_engine.engine.tokenizer.encode(PROMPT)


def complete(client, model, **kw):
    args = {"model": model, "prompt": PROMPT, "temperature": 0.0, "max_tokens": 12,
            "extra_body": {"ignore_eos": True}, **kw}
    return client.completions.create(**args)


def load(server, name, path):
    status, _, body = server.http("POST", "/v1/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(path)}, AUTH)
    return status, body


def unload(server, name):
    status, _, body = server.http("POST", "/v1/unload_lora_adapter", {"lora_name": name}, AUTH)
    return status, body


def error_of(status, body, expected_status, code):
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error["message"]


def model_ids(client):
    return [m.id for m in client.models.list().data]


def test_models_list_the_adapters_with_their_parent(server, client, dirs):
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:2] == ["tiny", "sql"]
    sql = models["sql"].model_dump()
    assert sql["parent"] == "tiny" and sql["root"] == os.path.realpath(dirs["allowed"] / "qv")
    assert models["tiny"].model_dump()["parent"] is None
    assert client.models.retrieve("sql") == models["sql"]  # GET /v1/models/{id}
    doc = json.loads(server.http("GET", "/openapi.json")[2])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert {"lora_name", "lora_path"} <= set(schemas["LoadLoraAdapterRequest"]["properties"])
    assert "parent" in schemas["ModelCard"]["properties"]


def test_model_names_an_adapter(client, tokenizer_ids, config):
    base = complete(client, "tiny")
    lora = complete(client, "sql")
    assert lora.model == "sql" and base.model == "tiny"
    assert lora.choices[0].text != base.choices[0].text
    # the same as the Engine run directly with the adapter, and without
    engine = Engine(config)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("with", tokenizer_ids, params, adapter="sql")
    engine.add_request("without", tokenizer_ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert lora.usage.completion_tokens == 12
    texts = {rid: engine.tokenizer.decode(ids) for rid, ids in done.items()}
    assert texts["with"] == lora.choices[0].text and texts["without"] == base.choices[0].text
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user",
                                                                  "content": "Hi"}],
                                          max_tokens=4, temperature=0.0)
    assert chat.model == "sql" and chat.usage.completion_tokens >= 1


def test_no_model_is_the_base_model(server, tokenizer_ids):
    status, _, body = server.http("POST", "/v1/completions",
                                  {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
                                   "ignore_eos": True}, AUTH)
    status_base, _, base = server.http("POST", "/v1/completions",
                                       {"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                        "temperature": 0.0, "ignore_eos": True}, AUTH)
    assert status == status_base == 200
    assert json.loads(body)["choices"][0]["text"] == json.loads(base)["choices"][0]["text"]
    # /tokenize takes an adapter's name too (adapters share the base model's tokenizer)
    status, _, body = server.http("POST", "/tokenize", {"model": "sql", "prompt": PROMPT}, AUTH)
    assert status == 200 and json.loads(body)["tokens"] == tokenizer_ids


def test_unknown_model_is_404_listing_the_adapters(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope")
    assert e.value.code == "model_not_found"
    assert "`tiny`" in e.value.message and "`sql`" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "Hi"}])
    error_of(*unload(server, "nope"), 404, "adapter_not_found")


def test_load_use_unload_through_the_api(server, client, dirs):
    base = complete(client, "tiny").choices[0].text
    text = client.post("/load_lora_adapter", cast_to=str,
                       body={"lora_name": "mlp", "lora_path": str(dirs["allowed"] / "mlp")})
    assert "mlp" in text and "Success" in text
    models = {m.id: m.model_dump() for m in client.models.list().data}
    assert models["mlp"]["parent"] == "tiny"
    assert models["mlp"]["root"] == os.path.realpath(dirs["allowed"] / "mlp")
    first = complete(client, "mlp").choices[0].text
    assert first != base and first != complete(client, "sql").choices[0].text
    # loading a loaded name again is refused (vLLM: 400 "already loaded")
    message = error_of(*load(server, "mlp", dirs["allowed"] / "qv"), 400, "adapter_exists")
    assert "already" in message
    text = client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "mlp"})
    assert "mlp" in text and "Success" in text
    assert "mlp" not in model_ids(client)
    with pytest.raises(openai.NotFoundError):
        complete(client, "mlp")
    error_of(*unload(server, "mlp"), 404, "adapter_not_found")
    # loaded again (a fresh namespace in the prefix cache): the same output as before
    assert load(server, "mlp", dirs["allowed"] / "mlp")[0] == 200
    assert complete(client, "mlp").choices[0].text == first
    assert unload(server, "mlp")[0] == 200


def test_runtime_updates_off_by_default(dirs):
    config = server_config(dirs["base"], **{"server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as server:
        for status, body in (load(server, "x", dirs["allowed"] / "qv"), unload(server, "sql")):
            message = error_of(status, body, 404, "runtime_updates_disabled")
            assert "lora.allow_runtime_updates = true" in message
        assert model_ids(server.client()) == ["tiny"]


def test_admin_tenants_alone_change_adapters(dirs):
    """With `server.admin_tenants` set, other tenants' keys get 403 on both routes and
    change nothing; an admin's key (a named tenant or an `api_keys[i]` one) loads and
    unloads."""
    config = server_config(dirs["base"], **{
        "server.served_model_name": "tiny", "server.api_keys": ["sk-ops-2"],
        "server.tenants": {"ops": ["sk-ops"], "acme": ["sk-acme"]},
        "server.admin_tenants": ["ops", "api_keys[0]"],
        "lora.allow_runtime_updates": True, "lora.allowed_dirs": [str(dirs["allowed"])],
        "lora.max_rank": 16, "lora.max_loras": 2})
    body = {"lora_name": "qv", "lora_path": str(dirs["allowed"] / "qv")}
    with ServerThread(config, Engine(config)) as server:
        def call(path, key, payload):
            status, _, raw = server.http("POST", path, payload,
                                         {"Authorization": f"Bearer {key}"})
            return status, raw

        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            message = error_of(*call(path, "sk-acme", body), 403, "not_an_admin")
            assert "server.admin_tenants" in message and "sk-" not in message
        assert not server.async_engine.adapters
        assert call("/v1/load_lora_adapter", "sk-ops", body)[0] == 200
        error_of(*call("/v1/unload_lora_adapter", "sk-acme", {"lora_name": "qv"}), 403,
                 "not_an_admin")
        assert list(server.async_engine.adapters) == ["qv"]
        assert call("/v1/unload_lora_adapter", "sk-ops-2", {"lora_name": "qv"})[0] == 200
        assert not server.async_engine.adapters


def test_admin_tenants_must_name_tenants(dirs):
    from heron.core.config import ConfigError
    with pytest.raises(ConfigError, match="admin_tenants.*must name tenants"):
        server_config(dirs["base"], **{"server.tenants": {"ops": ["sk-ops"]},
                                       "server.admin_tenants": ["opps"]})


def test_auth_applies_to_the_adapter_routes(server, dirs):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        body = {"lora_name": "qv2", "lora_path": str(dirs["allowed"] / "qv")}
        status, _, _ = server.http("POST", path, body)
        assert status == 401
    assert "qv2" not in server.async_engine.adapters


def test_paths_outside_allowed_dirs_are_refused(server, client, dirs):
    allowed, outside, root = dirs["allowed"], dirs["outside"], dirs["root"]
    (allowed / "link").symlink_to(outside / "evil", target_is_directory=True)
    mixed = allowed / "mixed"  # a real directory whose weights file links outside
    mixed.mkdir()
    shutil.copy(outside / "evil" / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(outside / "evil" /
                                                     "adapter_model.safetensors")
    cases = [outside / "evil",                               # absolute, outside
             f"{allowed}/../outside/evil",                   # `..` traversal
             allowed / "link",                               # a symlink leading outside
             mixed,                                          # a file linking outside
             root / "allowed-sibling" / "evil",              # a prefix of the name is not a parent
             "/etc"]
    for path in cases:
        message = error_of(*load(server, "evil", path), 403, "path_not_allowed")
        assert str(outside) not in message and str(allowed) not in message, message
        assert "allowed_dirs" in message
    assert "evil" not in model_ids(client)
    assert complete(client, "sql").choices[0].finish_reason == "length"


def _bad_adapters(dirs) -> dict[str, tuple[str, str]]:
    """name -> (path, words the 400's message must hold), each under the allowed dir."""
    allowed = dirs["allowed"] / "bad"
    allowed.mkdir()
    (allowed / "empty").mkdir()
    no_weights = allowed / "no-weights"
    no_weights.mkdir()
    shutil.copy(dirs["allowed"] / "qv" / "adapter_config.json", no_weights)
    build_adapter(dirs["base_model"], allowed / "rank32", r=32, alpha=32, targets=QV)
    foo = allowed / "foo"
    shutil.copytree(dirs["allowed"] / "qv", foo)
    config = json.loads((foo / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "foo_proj"]
    (foo / "adapter_config.json").write_text(json.dumps(config))
    other = build_tiny("llama", dirs["root"] / "other-base", hidden_size=32)
    build_adapter(other, allowed / "narrow", r=8, alpha=16, targets=QV)
    return {"missing": (allowed / "nothing-here", "not a directory"),
            "empty": (allowed / "empty", "adapter_config.json"),
            "no-weights": (no_weights, "adapter_model.safetensors"),
            "rank32": (allowed / "rank32", "max_rank"),
            "foo": (foo, "foo_proj"),
            "narrow": (allowed / "narrow", "shape")}


def test_bad_adapters_are_400_and_the_server_keeps_serving(server, client, dirs):
    before = complete(client, "sql").choices[0].text
    for name, (path, words) in _bad_adapters(dirs).items():
        message = error_of(*load(server, name, path), 400, "invalid_adapter")
        assert repr(name) in message and words in message, message
        with pytest.raises(openai.BadRequestError) as e:  # the client sees the same
            client.post("/load_lora_adapter", cast_to=str,
                        body={"lora_name": name, "lora_path": str(path)})
        assert words in e.value.message
    message = error_of(*load(server, "tiny", dirs["allowed"] / "qv"), 400, "adapter_exists")
    assert "base model" in message
    assert model_ids(client) == ["tiny", "sql"]
    assert complete(client, "sql").choices[0].text == before
    assert server.wait_for(lambda m: m["heron_requests_running"] == 0)[
        "heron_kv_blocks_in_use"] == 0


def test_unload_while_a_stream_uses_it_is_409(server, client, dirs):
    assert load(server, "busy", dirs["allowed"] / "qv")[0] == 200
    first_chunk, chunks = threading.Event(), []

    def stream():
        for chunk in complete(client, "busy", max_tokens=400, stream=True):
            chunks.append(chunk)
            first_chunk.set()

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        assert first_chunk.wait(60)
        message = error_of(*unload(server, "busy"), 409, "adapter_in_use")
        assert "`busy`" in message and "does not wait" in message
        assert "busy" in model_ids(client)
    finally:
        runner.join(120)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == complete(
        client, "busy", max_tokens=400).choices[0].text
    status, body = unload(server, "busy")
    assert status == 200, body
    assert "busy" not in model_ids(client)


def test_an_unload_runs_off_the_loop_and_requests_racing_it_get_404(server, client, dirs,
                                                                     monkeypatch):
    assert load(server, "slow", dirs["allowed"] / "qv")[0] == 200
    engine = server.async_engine.engine
    started, remove = threading.Event(), engine.remove_adapter

    def slow_remove(name):
        started.set()
        time.sleep(1.0)
        remove(name)

    monkeypatch.setattr(engine, "remove_adapter", slow_remove)
    with ThreadPoolExecutor(1) as pool:
        unloading = pool.submit(unload, server, "slow")
        assert started.wait(30)
        begin = time.monotonic()
        assert server.http("GET", "/health")[0] == 200
        assert time.monotonic() - begin < 0.5  # the worker thread unloads; the loop is free
        # admitted while "slow" was still listed, queued behind the unload: a 404, not a 400
        with pytest.raises(openai.NotFoundError) as e:
            complete(client, "slow")
        assert e.value.code == "model_not_found" and "unloaded" in e.value.message
        assert unloading.result()[0] == 200
    assert "slow" not in model_ids(client)
