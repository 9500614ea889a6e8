"""A BERT embedding model and a BERT cross-encoder served over HTTP: the openai client's
embeddings, and /score and /rerank, against transformers' models of the same checkpoints
(`tests.test_bert`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tests.test_bert import QUERY, hidden_states, probabilities
from tests.test_embeddings import PROMPTS
from tests.test_server_embeddings import post, serve
from tests.tiny_models import build_tiny_encoder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    model = build_tiny_encoder("bert", path)
    # a step budget under the longest prompt: inputs compute whole, a longer one alone
    with serve(path, **{"engine.max_num_batched_tokens": 32}) as server:
        yield server, model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-cls")
    model = build_tiny_encoder("bert-cls", path)
    with serve(path) as server:
        yield server, model, AutoTokenizer.from_pretrained(path)


def test_embeddings_over_the_openai_client(embedder):
    server, model, tokenizer = embedder
    assert max(len(tokenizer(p)["input_ids"]) for p in PROMPTS) > 32
    reply = server.client().embeddings.create(model="tiny", input=PROMPTS)
    for item, prompt in zip(reply.data, PROMPTS):
        expected = F.normalize(hidden_states(model, tokenizer, prompt)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-5,
                                   rtol=1e-5)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)


def test_an_input_past_the_positions_is_a_400_or_cut_when_asked(embedder):
    server, model, tokenizer = embedder
    text = " ".join(PROMPTS) * 4
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 128
    status, reply = post(server, "/v1/embeddings", {"input": text})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "at most 128" in reply["error"]["message"]
    status, reply = post(server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": -1,
                                                    "encoding_format": "float"})
    assert status == 200, reply
    with torch.no_grad():
        hidden = model(torch.tensor([ids[-128:]])).last_hidden_state[0]
    torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]),
                               F.normalize(hidden[0], dim=-1), atol=1e-5, rtol=1e-5)
    assert server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)


def test_a_cross_encoder_scores_and_reranks_typed_pairs(cross_encoder):
    server, model, tokenizer = cross_encoder
    expected = [float(probabilities(model, tokenizer, QUERY, p)) for p in PROMPTS]
    status, reply = post(server, "/score", {"text_1": QUERY, "text_2": PROMPTS})
    assert status == 200, reply
    assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=1e-5)
    status, ranked = post(server, "/v1/rerank", {"query": QUERY, "documents": PROMPTS})
    assert status == 200, ranked
    assert [r["index"] for r in ranked["results"]] == sorted(range(len(PROMPTS)),
                                                              key=lambda i: -expected[i])
    for r in ranked["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    status, classified = post(server, "/classify", {"input": PROMPTS[0]})
    assert status == 200, classified
    assert classified["data"][0]["probs"] == pytest.approx(
        probabilities(model, tokenizer, PROMPTS[0]).tolist(), abs=1e-5)
