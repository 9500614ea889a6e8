"""POST /score and /rerank (vLLM's routes; /rerank in Cohere's and Jina's shape too): how
relevant each of a list of texts is to another.

With an embedding model (vLLM's bi-encoder scoring) a pair's score is the cosine
similarity of its texts' vectors, and each text is embedded once: /score's one ``text_1``
against N ``text_2`` is N + 1 inputs, not 2N. With a classifier of one label (a
cross-encoder: `...ForSequenceClassification`, ``num_labels = 1``) each pair is one
input, its two texts in the tokenizer's pair template (BERT's second text of token type 1),
and its score the sigmoid of the label's logit; ``truncate_prompt_tokens`` cuts a pair as
transformers (and sentence-transformers' CrossEncoder) does: the template kept, the longer
text first losing tokens at its end (``truncation_side: "left"``: its start). A
cross-encoder given ``model.chat_template`` renders each pair through it instead (vLLM's
score templates: messages of roles "query" and "document", the request's
``chat_template_kwargs`` as its variables); then only the document is cut. Either way all
of a call's inputs run in the same steps (`embeddings.pool`), are checked as
/v1/embeddings' inputs are, and errors name the text (``text_2[3]``, ``documents[0]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from heron.core.chat_template import ChatTemplateError
from heron.core.tokenizer import Tokenizer
from heron.server.admission import (check_model, check_queue_room, check_template_kwargs,
                                    tokenizer_of, truncation_of)
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


@dataclass
class _Inputs:
    texts: list[str]  # the second field's
    ids: list[list[int]]
    num_firsts: int  # inputs that are the first field's texts (a bi-encoder's), 0 for pairs
    token_types: list[list[int]] | None = None  # pairs', for a model that reads types


def _bi_encoder_inputs(app: web.Application, req, first: tuple[str, Any],
                       second: tuple[str, Any]) -> _Inputs:
    """Every text of both fields, each embedded once."""
    _, firsts = encoded_inputs(app, req, first[1], first[0])
    texts, seconds = encoded_inputs(app, req, second[1], second[0])
    _check_pairing(len(firsts), len(seconds), first[0], second[0])
    return _Inputs(texts, firsts + seconds, len(firsts))


def _cross_encoder_inputs(app: web.Application, req, first: tuple[str, Any],
                          second: tuple[str, Any]) -> _Inputs:
    """Each pair as one input: its two texts through the score template where the model
    has one, else in the tokenizer's pair template."""
    firsts, texts = _texts(first[1], first[0]), _texts(second[1], second[0])
    _check_pairing(len(firsts), len(texts), first[0], second[0])
    tokenizer, engine = tokenizer_of(app), app[ASYNC_ENGINE].engine
    keep = truncation_of(req, engine.limits.max_embedding_len)
    side = req.truncation_side or "right"
    pairs = list(zip(firsts * len(texts) if len(firsts) == 1 else firsts, texts))
    try:
        if _has_score_template(app):
            check_template_kwargs(req.chat_template_kwargs)
            ids = [_templated_pair(tokenizer, a, b, req.chat_template_kwargs, keep, side)
                   for a, b in pairs]
            types = [[0] * len(i) for i in ids]
        else:
            encoded = [tokenizer.encode_pair(a, b, keep, side) for a, b in pairs]
            ids, types = [p[0] for p in encoded], [p[1] for p in encoded]
    except ChatTemplateError as e:
        raise bad_request(f"the score template refused a pair: {e}", param=first[0]) from None
    except ValueError as e:  # a keep too small for the template
        raise bad_request(f"`truncate_prompt_tokens`: {e}", param="truncate_prompt_tokens")
    check_lengths(app, ids, second[0])
    return _Inputs(texts, ids, 0, types if engine.runner.num_token_types else None)


def _has_score_template(app: web.Application) -> bool:
    """Whether a cross-encoder's pairs go through a score template: ``model.chat_template``
    or a GGUF's rerank template (never a decoder's own chat template: that is a chat's)."""
    return tokenizer_of(app).score_template is not None


def _templated_pair(tokenizer: Tokenizer, query: str, document: str,
                    kwargs: dict[str, Any] | None, keep: int | None, side: str) -> list[int]:
    """The ids of the score template's rendering of ``query`` and ``document``, with the
    tokenizer's special tokens (a BOS), as a cross-encoder's reference code encodes it. With
    ``keep``, the document loses tokens at its end (``side`` "left": its start) until the
    prompt holds at most that many; ValueError where the rest alone is longer."""
    def render(doc: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_score_template(query, doc, **(kwargs or {})))

    ids = render(document)
    if keep is None or len(ids) <= keep:
        return ids
    words = tokenizer.encode(document, add_special_tokens=False)
    while len(ids) > keep:
        if not words:
            raise ValueError(f"the score template and the query alone take {len(ids)} tokens, "
                             f"more than {keep}")
        cut = min(len(ids) - keep, len(words))
        words = words[:len(words) - cut] if side == "right" else words[cut:]
        ids = render(tokenizer.decode(words, skip_special_tokens=False))
    return ids


async def _pair_scores(request: web.Request, task: str, req, kind: str,
                       first: tuple[str, Any], second: tuple[str, Any]
                       ) -> tuple[Pooled, list[str], list[float]]:
    """Each pair's score: one ``first`` (a field's name and value) against every ``second``,
    or pairs in order; returns the response's makings and the second field's texts."""
    app = request.app
    adapter = check_model(app, req.model)
    if req.chat_template_kwargs and (task == "embed" or not _has_score_template(app)):
        raise bad_request("`chat_template_kwargs` are a score template's variables, and the "
                          f"model `{app[MODEL_NAME]}` scores without one (a cross-encoder's "
                          "model.chat_template)", param="chat_template_kwargs")
    make_inputs = _bi_encoder_inputs if task == "embed" else _cross_encoder_inputs
    inputs = make_inputs(app, req, first, second)
    check_queue_room(app, inputs.ids, second[0])
    pooled = await pool(request, kind, inputs.ids, req.priority, adapter, inputs.token_types)
    vectors = torch.stack(pooled.vectors).float()
    if not inputs.num_firsts:  # a cross-encoder's: each pair's probability
        return pooled, inputs.texts, vectors[:, 0].tolist()
    ones, others = vectors[:inputs.num_firsts], vectors[inputs.num_firsts:]
    cosines = torch.nn.functional.cosine_similarity(ones.expand_as(others), others, dim=-1)
    return pooled, inputs.texts, cosines.tolist()


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
