"""/classify, and /score and /rerank with a cross-encoder, on tiny sequence classifiers
served over HTTP; the oracle is transformers' model of the same checkpoint on transformers'
tokenization (`tests.test_classify`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.test_classify import oracle
from tests.test_embeddings import PROMPTS
from tests.test_server_embeddings import post, serve
from tests.tiny_models import add_chat_markers, build_tiny

QUERY = "Which animal jumps over the dog?"


@pytest.fixture(scope="module")
def labeller(tmp_path_factory):
    """Three labels (neg, neutral, pos)."""
    path = tmp_path_factory.mktemp("llama-cls")
    model = build_tiny("llama-cls", path)
    with serve(path) as server:
        yield server, model, path


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """One label: a relevance score."""
    path = tmp_path_factory.mktemp("qwen3-cls")
    model = build_tiny("qwen3-cls", path)
    with serve(path) as server:
        yield server, model, AutoTokenizer.from_pretrained(path)


def test_each_input_gets_its_labels_probabilities(labeller):
    server, model, path = labeller
    tokenizer = AutoTokenizer.from_pretrained(path)
    status, reply = post(server, "/classify", {"model": "tiny", "input": PROMPTS})
    assert status == 200, reply
    assert reply["object"] == "list" and reply["id"].startswith("classify-")
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    for i, (item, prompt_ids) in enumerate(zip(reply["data"], ids)):
        expected = oracle(model, prompt_ids)
        assert item["index"] == i and item["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(item["probs"]), expected, atol=1e-5, rtol=1e-5)
        assert item["label"] == model.config.id2label[int(expected.argmax())]
    assert reply["usage"] == {"prompt_tokens": sum(map(len, ids)),
                              "total_tokens": sum(map(len, ids))}
    # token ids, and an input cut to its last tokens
    status, by_ids = post(server, "/classify", {"input": ids[2], "truncate_prompt_tokens": 5})
    assert status == 200, by_ids
    torch.testing.assert_close(torch.tensor(by_ids["data"][0]["probs"]),
                               oracle(model, ids[2][-5:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("body,param,code", [
    ({"input": []}, "input", None),
    ({"input": [5] * 600}, "input", "context_length_exceeded"),
    ({"input": "a", "model": "other"}, "model", "model_not_found"),
    ({"input": "a", "encoding_format": "float"}, None, None),
])
def test_bad_classify_requests_get_openai_shaped_errors(labeller, body, param, code):
    server = labeller[0]
    status, reply = post(server, "/classify", body)
    assert status in (400, 404) and reply["error"]["message"], reply
    assert param is None or reply["error"]["param"] == param
    assert code is None or reply["error"]["code"] == code
    assert server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)


@pytest.mark.parametrize("path,body,code", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "classification_model"),
    ("/v1/completions", {"prompt": "hi"}, "classification_model"),
    ("/v1/embeddings", {"input": "hi"}, "not_an_embedding_model"),
    ("/score", {"text_1": "a", "text_2": "b"}, "not_a_cross_encoder"),
    ("/rerank", {"query": "a", "documents": ["b"]}, "not_a_cross_encoder"),
])
def test_a_classifier_serves_only_its_routes(labeller, path, body, code):
    status, reply = post(labeller[0], path, body)
    assert status == 400 and reply["error"]["code"] == code, reply
    if code == "classification_model":
        assert "/classify" in reply["error"]["message"]


def test_other_models_refuse_classify(tmp_path):
    build_tiny("qwen3", tmp_path, head_dim=32)
    for settings in ({}, {"model.task": "embed"}):
        with serve(tmp_path, **settings) as server:
            status, reply = post(server, "/classify", {"input": "hi"})
        assert status == 400 and reply["error"]["code"] == "not_a_classifier"


def test_a_cross_encoder_scores_each_pair_as_one_input(cross_encoder):
    server, model, tokenizer = cross_encoder
    expected = [float(oracle(model, tokenizer(QUERY, p)["input_ids"])) for p in PROMPTS]
    status, reply = post(server, "/score", {"text_1": QUERY, "text_2": PROMPTS})
    assert status == 200, reply
    assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=1e-5)
    pairs = sum(len(tokenizer(QUERY, p)["input_ids"]) for p in PROMPTS)
    assert reply["usage"]["prompt_tokens"] == pairs
    status, pairwise = post(server, "/v1/score", {"text_1": PROMPTS[:2], "text_2": PROMPTS[2:]})
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(oracle(model, tokenizer(a, b)["input_ids"]))
         for a, b in zip(PROMPTS[:2], PROMPTS[2:])], abs=1e-5)
    status, ranked = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS,
                                              "top_n": 3})
    assert status == 200, ranked
    order = sorted(range(len(PROMPTS)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in ranked["results"]] == order
    for r in ranked["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"]["text"] == PROMPTS[r["index"]]


@pytest.mark.parametrize("path,body,param", [
    ("/score", {"text_1": "a", "text_2": [[5, 6]]}, "text_2"),
    ("/rerank", {"query": [5, 6], "documents": ["b"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b", "long " * 600]}, "text_2[1]"),
    ("/rerank", {"query": "a", "documents": ["b"], "chat_template_kwargs": {"x": 1}},
     "chat_template_kwargs"),
])
def test_bad_cross_encoder_requests_get_openai_shaped_errors(cross_encoder, path, body, param):
    server = cross_encoder[0]
    status, reply = post(server, path, body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)


def test_a_causal_lm_reranks_by_two_tokens_of_its_lm_head(tmp_path):
    """Qwen3-Reranker's way (``classifier_from_tokens = ["no", "yes"]``; here two tokens the
    tiny vocabulary has): each pair's relevance is the second token's two-way probability
    at the pair's last position."""
    model = build_tiny("qwen3", tmp_path, head_dim=32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    no, yes = tokenizer.convert_tokens_to_ids(["a", "b"])
    with torch.no_grad():
        expected = [float(model(torch.tensor([tokenizer(QUERY, p)["input_ids"]])).logits[
            0, -1, [no, yes]].softmax(-1)[1]) for p in PROMPTS]
    with serve(tmp_path, **{"model.classifier_from_tokens": ["a", "b"]}) as server:
        status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS})
    assert status == 200, reply
    assert [r["index"] for r in reply["results"]] == sorted(range(len(PROMPTS)),
                                                            key=lambda i: -expected[i])
    for r in reply["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)


# Qwen3-Reranker's model card builds its prompt by hand, around the pair's tokens:
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
               "on the Query and the Instruct provided. Note that the answer can only be "
               "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANKER_TEMPLATE = Path(__file__).parents[1] / "conf" / "templates" / "qwen3_reranker.jinja"


def card_scores(model, tokenizer, query: str, documents: list[str],
                instruction: str = CARD_INSTRUCTION, max_length: int | None = None
                ) -> list[tuple[int, float]]:
    """Each document's (prompt length, relevance) as the model card computes them: prefix
    and suffix tokens around the pair's tokens, cut at their end to ``max_length`` in all;
    the probability of "yes" (here "b") against "no" ("a") at the last position."""
    prefix, suffix = (tokenizer.encode(t, add_special_tokens=False)
                      for t in (CARD_PREFIX, CARD_SUFFIX))
    no, yes = tokenizer.convert_tokens_to_ids(["a", "b"])
    out = []
    for document in documents:
        body = tokenizer.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n"
                                f"<Document>: {document}", add_special_tokens=False)
        if max_length is not None:
            body = body[:max_length - len(prefix) - len(suffix)]
        ids = prefix + body + suffix
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        out.append((len(ids), float(logits.softmax(-1)[1])))
    return out


@pytest.fixture(scope="module")
def llm_reranker(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer has Qwen's chat markers, served as Qwen3-Reranker is:
    two of its LM head's rows, and the shipped score template."""
    path = tmp_path_factory.mktemp("qwen3-reranker")
    model = build_tiny("qwen3", path, head_dim=32)
    add_chat_markers(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with serve(path, **{"model.classifier_from_tokens": ["a", "b"],
                        "model.chat_template": str(RERANKER_TEMPLATE)}) as server:
        yield server, model, tokenizer


def test_a_score_template_renders_each_pair_as_the_models_card_does(llm_reranker):
    """vLLM's score templates: each pair through ``model.chat_template`` as two messages,
    roles "query" and "document"; ``chat_template_kwargs`` are its variables (the shipped
    Qwen3-Reranker template's ``instruction``)."""
    server, model, tokenizer = llm_reranker
    expected = card_scores(model, tokenizer, QUERY, PROMPTS)
    status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS})
    assert status == 200, reply
    assert [r["index"] for r in reply["results"]] == sorted(range(len(PROMPTS)),
                                                            key=lambda i: -expected[i][1])
    for r in reply["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]][1], abs=1e-5)
    assert reply["usage"]["prompt_tokens"] == sum(n for n, _ in expected)
    instruction = "Given a question, find the sentence about animals"
    expected = card_scores(model, tokenizer, QUERY, PROMPTS[:2], instruction) + \
        card_scores(model, tokenizer, PROMPTS[0], PROMPTS[2:3], instruction)
    status, reply = post(server, "/score", {
        "text_1": [QUERY, QUERY, PROMPTS[0]], "text_2": PROMPTS[:3],
        "chat_template_kwargs": {"instruction": instruction}})
    assert status == 200, reply
    assert [d["score"] for d in reply["data"]] == pytest.approx([s for _, s in expected],
                                                                abs=1e-5)


def test_a_templated_pair_is_cut_in_its_document(llm_reranker):
    """``truncate_prompt_tokens`` keeps the template and the query whole and cuts the
    document at its end, as the model card cuts its pairs (``truncation_side: "left"``: at
    its start); a keep smaller than the rest is a 400, and nothing is held after it."""
    server, model, tokenizer = llm_reranker
    (length, _), = card_scores(model, tokenizer, QUERY, PROMPTS[:1])
    keep = length - 4
    (cut_length, score), = card_scores(model, tokenizer, QUERY, PROMPTS[:1], max_length=keep)
    assert cut_length == keep
    status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS[:1],
                                             "truncate_prompt_tokens": keep})
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == keep
    assert reply["results"][0]["relevance_score"] == pytest.approx(score, abs=1e-5)
    status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS[:1],
                                             "truncate_prompt_tokens": keep,
                                             "truncation_side": "left"})
    assert status == 200 and reply["usage"]["prompt_tokens"] <= keep, reply
    assert reply["results"][0]["relevance_score"] != pytest.approx(score, abs=1e-5)
    status, reply = post(server, "/rerank", {"query": QUERY, "documents": PROMPTS[:1],
                                             "truncate_prompt_tokens": 20})
    assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens", reply
    assert "the score template and the query alone take" in reply["error"]["message"]
    assert server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0)


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": True},
                                    {"special_tokens": {}}])
def test_score_template_kwargs_may_not_set_the_renderers_own(llm_reranker, kwargs):
    status, reply = post(llm_reranker[0], "/score", {"text_1": QUERY, "text_2": "x",
                                                     "chat_template_kwargs": kwargs})
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs", reply
    assert "may not set" in reply["error"]["message"]


def test_a_score_template_that_refuses_a_pair_is_a_400(tmp_path):
    build_tiny("qwen3", tmp_path, head_dim=32)
    template = ("{% if not messages[1].content %}{{ raise_exception('an empty document') }}"
                "{% endif %}{{ messages[0].content }} | {{ messages[1].content }}")
    with serve(tmp_path, **{"model.classifier_from_tokens": ["a", "b"],
                            "model.chat_template": template}) as server:
        status, reply = post(server, "/rerank", {"query": QUERY, "documents": ["x", ""]})
        assert status == 400 and reply["error"]["param"] == "query", reply
        assert "an empty document" in reply["error"]["message"]
        status, reply = post(server, "/rerank", {"query": QUERY, "documents": ["x"]})
        assert status == 200, reply
