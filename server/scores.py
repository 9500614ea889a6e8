"""POST /score and /rerank (vLLM's routes; /rerank in Cohere's and Jina's shape too): how
relevant each of a list of texts is to another.

With an embedding model (vLLM's bi-encoder scoring) a pair's score is the cosine
similarity of its texts' vectors, and each text is embedded once: /score's one ``text_1``
against N ``text_2`` is N + 1 inputs, not 2N. With a classifier of one label (a
cross-encoder: `...ForSequenceClassification`, ``num_labels = 1``) each pair is one
input, its two texts in the tokenizer's pair template, and its score the sigmoid of the
label's logit. Either way all of a call's inputs run in the same steps (`embeddings.pool`),
are truncated and checked as /v1/embeddings' inputs are, and errors name the text
(``text_2[3]``, ``documents[0]``).
"""

from __future__ import annotations

from typing import Any

import torch
from aiohttp import web

from heron.server.admission import check_model, check_queue_room, tokenizer_of, truncate_prompts
from heron.server.appkeys import ASYNC_ENGINE, MODEL_NAME
from heron.server.embeddings import (Pooled, check_lengths, encoded_inputs, pool,
                                     require_task)
from heron.server.errors import bad_request, decode_body
from heron.server.protocol import RerankRequest, ScoreRequest
from heron.server.responses import (RerankDocument, RerankResponse, RerankResult, Score,
                                    ScoreResponse, json_response)


def _serving_task(app: web.Application, route: str) -> str:
    """"embed" or "classify" (a cross-encoder); a 400 for any other model."""
    task = require_task(app, route, "embed", "classify")
    labels = app[ASYNC_ENGINE].engine.pooler.pooling.labels
    if task == "classify" and len(labels) != 1:
        raise bad_request(f"the model `{app[MODEL_NAME]}` classifies into {len(labels)} "
                          f"labels: {route} takes an embedding model or a classifier of one "
                          "label (a cross-encoder)", param="model", code="not_a_cross_encoder")
    return task


def _texts(value: Any, field: str) -> list[str]:
    """A cross-encoder's field: a text or a non-empty list of texts."""
    texts = [value] if isinstance(value, str) else value
    if not texts or not all(isinstance(t, str) for t in texts):
        raise bad_request(f"`{field}` must be a text or a list of texts: a cross-encoder reads "
                          "its pairs as text", param=field)
    return texts


def _check_pairing(num_firsts: int, num_seconds: int, field_1: str, field_2: str) -> None:
    if num_firsts not in (1, num_seconds):
        raise bad_request(f"`{field_1}` has {num_firsts} texts and `{field_2}` {num_seconds}: "
                          "score one against any number (1:N) or pairs in order (N:N)",
                          param=field_1)


def _bi_encoder_inputs(app: web.Application, req, first: tuple[str, Any],
                       second: tuple[str, Any]) -> tuple[list[str], list[list[int]], int]:
    """Every text of both fields, each embedded once: (the second field's texts, the
    inputs, how many of them are the first field's)."""
    _, firsts = encoded_inputs(app, req, first[1], first[0])
    texts, seconds = encoded_inputs(app, req, second[1], second[0])
    _check_pairing(len(firsts), len(seconds), first[0], second[0])
    return texts, firsts + seconds, len(firsts)


def _cross_encoder_inputs(app: web.Application, req, first: tuple[str, Any],
                          second: tuple[str, Any]) -> tuple[list[str], list[list[int]], int]:
    """Each pair as one input, the tokenizer's pair template around its two texts: (the
    second field's texts, the inputs, 0)."""
    firsts, texts = _texts(first[1], first[0]), _texts(second[1], second[0])
    _check_pairing(len(firsts), len(texts), first[0], second[0])
    tokenizer = tokenizer_of(app)
    pairs = [tokenizer.encode_pair(a, b)
             for a, b in zip(firsts * len(texts) if len(firsts) == 1 else firsts, texts)]
    pairs = truncate_prompts(pairs, req, app[ASYNC_ENGINE].engine.limits.max_embedding_len)
    check_lengths(app, pairs, second[0])
    return texts, pairs, 0


async def _pair_scores(request: web.Request, task: str, req, kind: str,
                       first: tuple[str, Any], second: tuple[str, Any]
                       ) -> tuple[Pooled, list[str], list[float]]:
    """Each pair's score: one ``first`` (a field's name and value) against every ``second``,
    or pairs in order; returns the response's makings and the second field's texts."""
    app = request.app
    adapter = check_model(app, req.model)
    make_inputs = _bi_encoder_inputs if task == "embed" else _cross_encoder_inputs
    texts, inputs, num_firsts = make_inputs(app, req, first, second)
    check_queue_room(app, inputs, second[0])
    pooled = await pool(request, kind, inputs, req.priority, adapter)
    vectors = torch.stack(pooled.vectors).float()
    if not num_firsts:  # a cross-encoder's: each pair's probability
        return pooled, texts, vectors[:, 0].tolist()
    ones, others = vectors[:num_firsts], vectors[num_firsts:]
    cosines = torch.nn.functional.cosine_similarity(ones.expand_as(others), others, dim=-1)
    return pooled, texts, cosines.tolist()


async def create_score(request: web.Request) -> web.Response:
    task = _serving_task(request.app, request.path)
    req = await decode_body(request, ScoreRequest)
    pooled, _, scores = await _pair_scores(request, task, req, "score",
                                           ("text_1", req.text_1), ("text_2", req.text_2))
    return json_response(ScoreResponse(
        id=pooled.id, created=pooled.created, model=pooled.model,
        data=[Score(index=i, score=s) for i, s in enumerate(scores)], usage=pooled.usage))


async def create_rerank(request: web.Request) -> web.Response:
    task = _serving_task(request.app, request.path)
    req = await decode_body(request, RerankRequest)
    if any(type(d) is int for d in req.documents):  # not one document's token ids
        raise bad_request("`documents` must be a list of texts or of token id lists",
                          param="documents")
    pooled, texts, scores = await _pair_scores(request, task, req, "rerank",
                                               ("query", req.query),
                                               ("documents", req.documents))
    ranked = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties in order
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=texts[i]) if req.return_documents
                            else None)
               for i in ranked[:req.top_n or None]]
    return json_response(RerankResponse(id=pooled.id, model=pooled.model, results=results,
                                        usage=pooled.usage))
