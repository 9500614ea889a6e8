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

from heron.server.admission import (check_model, check_queue_room, encode_prompts, tokenizer_of,
                                    truncate_prompts)
from heron.server.appkeys import ASYNC_ENGINE, MODEL_NAME
from heron.server.embeddings import Pooled, check_lengths, pool, require_task
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


def _ids(app: web.Application, req, value, field: str) -> tuple[list[str], list[list[int]]]:
    """A field's texts and their token ids, truncated as ``req`` asks and checked."""
    texts, ids = encode_prompts(app, value, field=field)
    ids = truncate_prompts(ids, req, app[ASYNC_ENGINE].engine.limits.max_embedding_len)
    check_lengths(app, ids, field)
    return texts, ids


def _texts(value: Any, field: str) -> list[str]:
    """A cross-encoder's field: a text or a non-empty list of texts."""
    texts = [value] if isinstance(value, str) else value
    if not texts or not all(isinstance(t, str) for t in texts):
        raise bad_request(f"`{field}` must be a text or a list of texts: a cross-encoder reads "
                          "its pairs as text", param=field)
    return texts


async def _pair_scores(request: web.Request, task: str, req, kind: str,
                       first: tuple[str, Any], second: tuple[str, Any]
                       ) -> tuple[Pooled, list[str], list[float]]:
    """Each pair's score: one ``first`` (a field's name and value) against every ``second``,
    or pairs in order; returns the response's makings and the second field's texts."""
    app = request.app
    adapter = check_model(app, req.model)
    (field_1, value_1), (field_2, value_2) = first, second
    if task == "embed":
        _, firsts = _ids(app, req, value_1, field_1)
        texts, seconds = _ids(app, req, value_2, field_2)
    else:
        firsts, texts = _texts(value_1, field_1), _texts(value_2, field_2)
        seconds = texts
    if len(firsts) not in (1, len(seconds)):
        raise bad_request(f"`{field_1}` has {len(firsts)} texts and `{field_2}` "
                          f"{len(seconds)}: score one against any number (1:N) or pairs in "
                          "order (N:N)", param=field_1)
    if task == "embed":
        inputs = firsts + seconds
    else:
        tokenizer = tokenizer_of(app)
        inputs = [tokenizer.encode_pair(a, b)
                  for a, b in zip(firsts * len(seconds) if len(firsts) == 1 else firsts, texts)]
        inputs = truncate_prompts(inputs, req, app[ASYNC_ENGINE].engine.limits.max_embedding_len)
        check_lengths(app, inputs, field_2)
    check_queue_room(app, inputs, field_2)
    pooled = await pool(request, kind, inputs, req.priority, adapter)
    if task == "classify":
        return pooled, texts, [float(v[0]) for v in pooled.vectors]
    vectors = torch.stack(pooled.vectors).float()
    ones, others = vectors[:len(firsts)], vectors[len(firsts):]
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
