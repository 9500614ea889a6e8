"""A BERT embedding model and BERT and DeBERTa cross-encoders served over HTTP: the openai
client's embeddings, and /score and /rerank, against transformers' models of the same
checkpoints (`tests.test_bert`)."""

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


@pytest.fixture(scope="module", params=["bert-cls", "deberta-v2-cls"])
def cross_encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_tiny_encoder(request.param, path)
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
    """A cut keeps ``[CLS]`` and ``[SEP]`` (what the model pools and was trained on), as
    transformers' tokenizer truncates, whether the input came as text or as its ids."""
    server, model, tokenizer = embedder
    text = " ".join(PROMPTS) * 4
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 128
    status, reply = post(server, "/v1/embeddings", {"input": text})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "at most 128" in reply["error"]["message"]
    for keep, side in [(-1, None), (20, None), (20, "right")]:
        tokenizer.truncation_side = side or "left"
        cut = tokenizer(text, truncation=True, max_length=128 if keep == -1 else keep)
        for value in (text, ids):
            status, reply = post(server, "/v1/embeddings", {
                "input": value, "truncate_prompt_tokens": keep, "truncation_side": side,
                "encoding_format": "float"})
            assert status == 200, reply
            assert reply["usage"]["prompt_tokens"] == len(cut["input_ids"])
            with torch.no_grad():
                hidden = model(torch.tensor([cut["input_ids"]])).last_hidden_state[0]
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


def test_a_cross_encoder_types_and_cuts_pairs_as_transformers(cross_encoder):
    """A pair's token types are the tokenizer's, also where a text spells the separator;
    ``truncate_prompt_tokens`` cuts a pair as transformers does (the template kept, the
    longer text first, at its end or with ``truncation_side: "left"`` its start)."""
    server, model, tokenizer = cross_encoder
    spelt, long_doc = f"the fox {tokenizer.sep_token} jumps over", " ".join(PROMPTS)
    status, reply = post(server, "/score", {"text_1": spelt, "text_2": [QUERY, long_doc]})
    assert status == 200, reply
    assert [d["score"] for d in reply["data"]] == pytest.approx(
        [float(probabilities(model, tokenizer, spelt, d)) for d in (QUERY, long_doc)], abs=1e-5)
    docs = [long_doc, PROMPTS[0]]
    for keep, side in [(24, None), (24, "left"), (9, None)]:
        tokenizer.truncation_side = side or "right"
        cut = [tokenizer(QUERY, doc, truncation=True, max_length=keep, return_tensors="pt",
                         return_token_type_ids=True)
               for doc in docs]
        with torch.no_grad():
            expected = [float(model(**c).logits[0, 0].sigmoid()) for c in cut]
        status, ranked = post(server, "/rerank", {
            "query": QUERY, "documents": docs, "truncate_prompt_tokens": keep,
            "truncation_side": side})
        assert status == 200, ranked
        assert ranked["usage"]["prompt_tokens"] == sum(c["input_ids"].numel() for c in cut)
        for r in ranked["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    status, reply = post(server, "/rerank", {"query": QUERY, "documents": docs,
                                              "truncate_prompt_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens", reply
    assert "3 special tokens" in reply["error"]["message"]
    assert server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)
