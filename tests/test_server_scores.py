"""/score and /rerank on a tiny Qwen3 served with ``model.task = "embed"``: each pair's score
against the cosine of transformers' vectors for the same token ids (`tests.test_embeddings`'
oracle), over HTTP as vLLM's clients send them."""

from __future__ import annotations

import pytest
import torch

from tests.test_embeddings import PROMPTS, oracle
from tests.test_server_embeddings import model_dir, post, serve  # noqa: F401 (a fixture)

QUERY = "Which animal jumps over the dog?"


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    with serve(model_dir, **{"model.task": "embed"}) as server:
        yield server


def expected(model_dir, server, first: str, second: str) -> float:  # noqa: F811
    """The cosine of transformers' (unit) vectors: their dot product."""
    encode = server.async_engine.engine.tokenizer.encode
    return float(oracle(model_dir, encode(first), "last") @ oracle(model_dir, encode(second),
                                                                   "last"))


def test_one_text_scores_against_each_of_many(server, model_dir):  # noqa: F811
    encode = server.async_engine.engine.tokenizer.encode
    status, reply = post(server, "/score", {"model": "tiny", "text_1": QUERY,
                                            "text_2": PROMPTS})
    assert status == 200, reply
    assert reply["object"] == "list" and reply["model"] == "tiny"
    assert reply["id"].startswith("score-")
    assert [d["index"] for d in reply["data"]] == list(range(len(PROMPTS)))
    for item, prompt in zip(reply["data"], PROMPTS):
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(expected(model_dir, server, QUERY, prompt),
                                              abs=1e-5)
    # the query is embedded once, not once a pair
    tokens = len(encode(QUERY)) + sum(len(encode(p)) for p in PROMPTS)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    _, again = post(server, "/v1/score", {"text_1": [QUERY], "text_2": PROMPTS})
    assert [d["score"] for d in again["data"]] == pytest.approx(
        [d["score"] for d in reply["data"]], abs=1e-6)


def test_lists_of_one_length_pair_up_in_order(server, model_dir):  # noqa: F811
    firsts, seconds = PROMPTS[:2], PROMPTS[2:]
    status, reply = post(server, "/v1/score", {"text_1": firsts, "text_2": seconds})
    assert status == 200, reply
    assert [d["score"] for d in reply["data"]] == pytest.approx(
        [expected(model_dir, server, a, b) for a, b in zip(firsts, seconds)], abs=1e-5)
    status, reply = post(server, "/score", {"text_1": PROMPTS[0], "text_2": PROMPTS[0]})
    assert status == 200 and reply["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    status, reply = post(server, "/score", {"text_1": PROMPTS[:2], "text_2": PROMPTS[:3]})
    assert status == 400 and reply["error"]["param"] == "text_1"
    assert "1:N" in reply["error"]["message"]


def test_rerank_orders_documents_by_their_cosine_with_the_query(server, model_dir):  # noqa: F811
    status, reply = post(server, "/rerank", {"model": "tiny", "query": QUERY,
                                             "documents": PROMPTS})
    assert status == 200, reply
    assert reply["id"].startswith("rerank-") and reply["model"] == "tiny"
    results = reply["results"]
    oracle_scores = [expected(model_dir, server, QUERY, p) for p in PROMPTS]
    assert sorted(r["index"] for r in results) == list(range(len(PROMPTS)))
    for r in results:
        assert r["relevance_score"] == pytest.approx(oracle_scores[r["index"]], abs=1e-5)
        assert r["document"] == {"text": PROMPTS[r["index"]]}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert [r["index"] for r in results] == sorted(range(len(PROMPTS)),
                                                   key=lambda i: -oracle_scores[i])
    encode = server.async_engine.engine.tokenizer.encode
    assert reply["usage"]["total_tokens"] == len(encode(QUERY)) + sum(
        len(encode(p)) for p in PROMPTS)
    # top_n keeps the most relevant; the same ranking on every path
    for path in ("/v1/rerank", "/v2/rerank"):
        status, top = post(server, path, {"query": QUERY, "documents": PROMPTS, "top_n": 2,
                                          "return_documents": False})
        assert status == 200, top
        assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
        assert all(set(r) == {"index", "relevance_score"} for r in top["results"])


def test_scores_are_cosines_when_vectors_are_not_normalized(model_dir):  # noqa: F811
    with serve(model_dir, **{"model.task": "embed", "model.normalize": False}) as server:
        status, reply = post(server, "/score", {"text_1": QUERY, "text_2": PROMPTS[:2]})
        encode = server.async_engine.engine.tokenizer.encode
    assert status == 200, reply
    query = oracle(model_dir, encode(QUERY), "last", normalize=False)
    for item, prompt in zip(reply["data"], PROMPTS):
        other = oracle(model_dir, encode(prompt), "last", normalize=False)
        cosine = float(query @ other / (query.norm() * other.norm()))
        assert item["score"] == pytest.approx(cosine, abs=1e-5)


def test_truncate_prompt_tokens_cuts_every_text(server, model_dir):  # noqa: F811
    long_ids = [(7 * i) % 300 + 3 for i in range(600)]  # past the 512-token context
    status, reply = post(server, "/score", {"text_1": long_ids, "text_2": [long_ids[:5]],
                                            "truncate_prompt_tokens": 4})
    assert status == 200, reply
    first = oracle(model_dir, long_ids[-4:], "last")
    second = oracle(model_dir, long_ids[1:5], "last")
    assert reply["data"][0]["score"] == pytest.approx(float(first @ second), abs=1e-5)
    assert reply["usage"]["prompt_tokens"] == 8


@pytest.mark.parametrize("path,body,param,code", [
    ("/score", {"text_1": "a"}, None, None),
    ("/score", {"text_1": [], "text_2": "a"}, "text_1", None),
    ("/score", {"text_1": "a", "text_2": ["b", [5] * 600]}, "text_2[1]",
     "context_length_exceeded"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model", "model_not_found"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": True}, None, None),
    ("/score", {"text_1": "a", "text_2": [[5]] * 256}, "text_2", "limit_exceeded"),
    ("/rerank", {"query": "a", "documents": []}, "documents", None),
    ("/rerank", {"query": "a", "documents": [1, 2]}, "documents", None),
    ("/rerank", {"query": "a", "documents": ["b", {"text": "c"}]}, "documents[1]", None),
    ("/rerank", {"query": ["a", "b"], "documents": ["c"]}, None, None),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, None, None),
    ("/rerank", {"query": [5] * 600, "documents": ["b"]}, "query", "context_length_exceeded"),
    ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", None),
])
def test_bad_requests_get_openai_shaped_errors(server, path, body, param, code):
    status, reply = post(server, path, body)
    assert status in (400, 404), reply
    error = reply["error"]
    assert error["message"] and (param is None or error["param"] == param)
    assert code is None or error["code"] == code
    values = server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)
    assert values["heron_kv_blocks_in_use"] == 0


@pytest.mark.parametrize("path,body", [("/v1/score", {"text_1": "a", "text_2": "b"}),
                                       ("/rerank", {"query": "a", "documents": ["b"]})])
def test_a_generating_model_refuses_scores(model_dir, path, body):  # noqa: F811
    with serve(model_dir) as server:
        status, reply = post(server, path, body)
    assert status == 400 and reply["error"]["code"] == "not_an_embedding_model"
    assert path in reply["error"]["message"]


def test_scores_and_embeddings_agree(server):
    status, embedded = post(server, "/v1/embeddings", {"input": [QUERY, PROMPTS[1]]})
    _, scored = post(server, "/score", {"text_1": QUERY, "text_2": PROMPTS[1]})
    a, b = (torch.tensor(d["embedding"]) for d in embedded["data"])
    assert status == 200 and scored["data"][0]["score"] == pytest.approx(float(a @ b), abs=1e-6)
