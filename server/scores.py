"""POST /score and /rerank (vLLM's routes; /rerank in Cohere's and Jina's shape too) for
embedding models: a pair's score is the cosine similarity of its two texts' vectors, as
vLLM scores with a bi-encoder.

Every text is embedded once, all of a call's texts in the same steps (`embeddings.pool`):
/score's one ``text_1`` against N ``text_2`` is N + 1 inputs, not 2N. Texts are checked
and truncated as /v1/embeddings' inputs are, each named by its field in errors
(``text_2[3]``, ``documents[0]``).
"""

from __future__ import annotations

import torch
from aiohttp import web

from heron.server.admission import check_model, check_queue_room, encode_prompts, truncate_prompts
from heron.server.appkeys import ASYNC_ENGINE
from heron.server.embeddings import check_lengths, pool, require_embedding_model
from heron.server.errors import bad_request, decode_body
from heron.server.protocol import RerankRequest, ScoreRequest
from heron.server.responses import (RerankDocument, RerankResponse, RerankResult, Score,
                                    ScoreResponse, json_response)


def _texts(app: web.Application, req, value, field: str) -> tuple[list[str], list[list[int]]]:
    """A field's texts and their token ids, truncated as ``req`` asks and checked."""
    texts, ids = encode_prompts(app, value, field=field)
    ids = truncate_prompts(ids, req, app[ASYNC_ENGINE].engine.limits.max_embedding_len)
    check_lengths(app, ids, field)
    return texts, ids


def _similarity(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """The cosine similarity of each row of ``a`` with the same row of ``b``."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).tolist()


async def create_score(request: web.Request) -> web.Response:
    app = request.app
    require_embedding_model(app, request.path)
    req = await decode_body(request, ScoreRequest)
    adapter = check_model(app, req.model)
    _, first = _texts(app, req, req.text_1, "text_1")
    _, second = _texts(app, req, req.text_2, "text_2")
    if len(first) not in (1, len(second)):
        raise bad_request(f"`text_1` has {len(first)} texts and `text_2` {len(second)}: "
                          "score one against any number (1:N) or pairs in order (N:N)",
                          param="text_1")
    check_queue_room(app, first + second, "text_2")
    pooled = await pool(request, "score", first + second, req.priority, adapter)
    vectors = torch.stack(pooled.vectors)
    queries, others = vectors[:len(first)], vectors[len(first):]
    scores = _similarity(queries.expand_as(others), others)
    return json_response(ScoreResponse(
        id=pooled.id, created=pooled.created, model=pooled.model,
        data=[Score(index=i, score=s) for i, s in enumerate(scores)], usage=pooled.usage))


async def create_rerank(request: web.Request) -> web.Response:
    app = request.app
    require_embedding_model(app, request.path)
    req = await decode_body(request, RerankRequest)
    adapter = check_model(app, req.model)
    if any(type(d) is int for d in req.documents):  # not one document's token ids
        raise bad_request("`documents` must be a list of texts or of token id lists",
                          param="documents")
    _, query = _texts(app, req, req.query, "query")
    texts, documents = _texts(app, req, req.documents, "documents")
    check_queue_room(app, query + documents, "documents")
    pooled = await pool(request, "rerank", query + documents, req.priority, adapter)
    vectors = torch.stack(pooled.vectors)
    scores = _similarity(vectors[:1].expand(len(documents), -1), vectors[1:])
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties in order
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=texts[i]) if req.return_documents
                            else None)
               for i in ranked[:req.top_n or None]]
    return json_response(RerankResponse(id=pooled.id, model=pooled.model, results=results,
                                        usage=pooled.usage))
