"""/v1/embeddings through the openai client (`client.embeddings`) on a tiny Qwen3 served with
``model.task = "embed"``; the oracle is transformers' bare model (`tests.test_embeddings`)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.test_embeddings import PROMPTS, oracle
from tests.tiny_models import COMMON, build_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed-server")
    build_tiny("qwen3", path, head_dim=32)
    return path


def serve(model_dir, **settings):
    config = server_config(model_dir, **{"server.served_model_name": "tiny", **settings})
    return ServerThread(config, Engine(config))


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, **{"model.task": "embed"}) as server:
        yield server


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = server.http("POST", path, body)
    return status, json.loads(raw)


def test_each_input_gets_its_vector_in_order(server, model_dir):
    tokenizer = server.async_engine.engine.tokenizer
    reply = server.client().embeddings.create(model="tiny", input=PROMPTS)  # base64 on the wire
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert [d.index for d in reply.data] == list(range(len(PROMPTS)))
    for item, prompt_ids in zip(reply.data, ids):
        assert item.object == "embedding" and len(item.embedding) == COMMON["hidden_size"]
        torch.testing.assert_close(torch.tensor(item.embedding),
                                   oracle(model_dir, prompt_ids, "last"), atol=1e-5, rtol=1e-5)
    assert reply.model == "tiny" and reply.object == "list"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    # the same vectors as floats, and for token ids (one list, or a list of lists)
    floats = server.client().embeddings.create(model="tiny", input=PROMPTS,
                                               encoding_format="float")
    by_ids = server.client().embeddings.create(model="tiny", input=ids)
    one = server.client().embeddings.create(model="tiny", input=ids[0])
    for reply_b in (floats, by_ids):
        for a, b in zip(reply.data, reply_b.data):
            np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, reply.data[0].embedding, atol=1e-6)


def test_dimensions_shorten_a_matryoshka_model_s_vectors(model_dir):
    settings = {"model.task": "embed", "model.matryoshka_dimensions": [16, 32]}
    with serve(model_dir, **settings) as server:
        tokenizer = server.async_engine.engine.tokenizer
        for encoding in ({}, {"encoding_format": "float"}):  # base64 on the wire, floats
            reply = server.client().embeddings.create(model="tiny", input=PROMPTS[:2],
                                                      dimensions=16, **encoding)
            for item, prompt in zip(reply.data, PROMPTS):
                full = oracle(model_dir, tokenizer.encode(prompt), "last", normalize=False)
                torch.testing.assert_close(torch.tensor(item.embedding),
                                           F.normalize(full[:16], dim=-1), atol=1e-5, rtol=1e-5)
        status, reply = post(server, "/v1/embeddings", {"input": "a", "dimensions": 24})
        assert status == 400 and reply["error"]["param"] == "dimensions"
        assert "may be shortened to 16, 32" in reply["error"]["message"]


def test_base64_is_the_little_endian_float32_bytes(server):
    status, as_b64 = post(server, "/v1/embeddings", {"input": PROMPTS[:2],
                                                     "encoding_format": "base64"})
    _, as_floats = post(server, "/v1/embeddings", {"input": PROMPTS[:2]})
    assert status == 200 and set(as_b64) == {"id", "object", "created", "model", "data", "usage"}
    for a, b in zip(as_b64["data"], as_floats["data"]):
        decoded = np.frombuffer(base64.b64decode(a["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, b["embedding"], atol=1e-6)


def test_chat_messages_embed_as_the_template_renders_them(server, model_dir):
    """vLLM's chat form: ``messages`` through the chat template (no generation prompt
    unless asked), one vector; transformers' rendering of the same chat is the input."""
    chat = [{"role": "system", "content": "Embed the question."},
            {"role": "user", "content": PROMPTS[0]}]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for add_generation_prompt in (False, True):
        ids = tokenizer.apply_chat_template(chat, tokenize=True,
                                            add_generation_prompt=add_generation_prompt)
        ids = ids["input_ids"]
        status, reply = post(server, "/v1/embeddings", {
            "messages": chat, "add_generation_prompt": add_generation_prompt})
        assert status == 200 and len(reply["data"]) == 1
        assert reply["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]),
                                   oracle(model_dir, ids, "last"), atol=1e-5, rtol=1e-5)


def test_a_call_s_inputs_run_in_one_step(model_dir):
    with serve(model_dir, **{"model.task": "embed"}) as server:
        engine = server.async_engine.engine
        batches, forward = [], engine.runner.forward
        engine.runner.forward = lambda batch: batches.append(len(batch.seqs)) or forward(batch)
        server.client().embeddings.create(model="tiny", input=[p[:20] for p in PROMPTS])
    assert batches == [len(PROMPTS)]


def test_truncate_prompt_tokens_embeds_each_input_s_last_tokens(server, model_dir):
    long_ids = [(7 * i) % 300 + 3 for i in range(600)]  # past the 512-token context
    for keep, kept in ((-1, long_ids[-512:]), (10, long_ids[-10:])):
        status, reply = post(server, "/v1/embeddings", {
            "input": [long_ids, long_ids[:5]], "truncate_prompt_tokens": keep})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == len(kept) + min(5, len(kept))
        torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]),
                                   oracle(model_dir, kept, "last"), atol=1e-5, rtol=1e-5)
    for keep in (0, 513):
        status, reply = post(server, "/v1/embeddings", {"input": "a",
                                                        "truncate_prompt_tokens": keep})
        assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("body,status,param,code", [
    ({"input": []}, 400, "input", None),
    ({"input": ""}, 400, "input", None),
    ({"input": [[1, 2], "text"]}, 200, None, None),
    ({"input": [1, "a"]}, 400, "input", None),
    ({"input": [[5, 99999]]}, 400, "input", None),
    ({"input": [5] * 600}, 400, "input", "context_length_exceeded"),
    ({"input": ["a", [5] * 600]}, 400, "input[1]", "context_length_exceeded"),
    ({"input": "a", "dimensions": 3}, 400, "dimensions", None),  # not a Matryoshka model
    ({"input": "a", "dimensions": 0}, 400, "dimensions", None),
    ({"input": "a", "dimensions": COMMON["hidden_size"] + 1}, 400, "dimensions", None),
    ({"input": "a", "dimensions": COMMON["hidden_size"]}, 200, None, None),
    ({"input": [[5]] * 257}, 400, "input", "limit_exceeded"),
    ({"input": "a", "model": "other"}, 404, "model", "model_not_found"),
    ({"input": "a", "encoding_format": "int8"}, 400, None, None),
    ({"input": "a", "temperature": 0.5}, 400, None, None),
    ({"input": "a", "priority": 3}, 400, "priority", None),  # engine.scheduling_policy fcfs
    ({}, 400, "input", None),
    ({"input": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "input", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", None),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, param, code):
    got, reply = post(server, "/v1/embeddings", body)
    assert got == status, reply
    if status != 200:
        error = reply["error"]
        assert error["message"] and (param is None or error["param"] == param)
        assert code is None or error["code"] == code
    values = server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)
    assert values["heron_kv_blocks_in_use"] == 0


def test_a_call_past_the_queue_s_token_limit_is_refused_not_retried(model_dir):
    with serve(model_dir, **{"model.task": "embed", "server.max_waiting_tokens": 64}) as server:
        status, reply = post(server, "/v1/embeddings", {"input": [[5] * 40, [6] * 40]})
        assert status == 400 and reply["error"]["code"] == "limit_exceeded"
        assert "server.max_waiting_tokens" in reply["error"]["message"]
        # one input is let in when nothing waits, as every prompt is
        status, _ = post(server, "/v1/embeddings", {"input": [[5] * 80]})
        assert status == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
])
def test_an_embedding_model_refuses_to_generate(server, path, body):
    status, reply = post(server, path, {"model": "tiny", **body})
    assert status == 400 and reply["error"]["code"] == "embedding_model"
    assert "/v1/embeddings" in reply["error"]["message"]


def test_a_generating_model_refuses_embeddings(model_dir):
    with serve(model_dir) as server:
        status, reply = post(server, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and reply["error"]["code"] == "not_an_embedding_model"
