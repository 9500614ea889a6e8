"""POST /v1/embeddings: inputs in, one vector each out (embedding models only).

``input`` is a text or texts, token ids or lists of them (or chat ``messages``, rendered by
the model's chat template, one input); each becomes one engine request
whose prompt the model pools (`heron.core.pooling`), and all of a call's inputs run in the
same steps. An input longer than the model's context is a 400, cut only when
``truncate_prompt_tokens`` asks for its last tokens. Vectors come back
as floats, or with ``encoding_format: "base64"`` (what the openai client asks for unless
told otherwise) as the base64 of their little-endian float32 bytes. ``dimensions``
shortens them to their first values (normalized again), for a model trained to allow it
(`Pooling.check_dimensions`); their own width is always accepted.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch
from aiohttp import web

from heron.core.sampling_params import SamplingParams
from heron.server.admission import (chat_prompt, check_message_parts, check_model,
                                    check_queue_room, encode_prompts, truncate_prompts,
                                    validated)
from heron.server.appkeys import ASYNC_ENGINE, CONFIG, MODEL_NAME
from heron.server.errors import bad_request, decode_body
from heron.server.generation import Generation
from heron.server.protocol import EmbeddingRequest
from heron.server.responses import (Embedding, EmbeddingResponse, EmbeddingUsage,
                                    json_response)


def served_task(app: web.Application) -> str:
    """What the model serves: "generate", "embed" or "classify" (`heron.core.pooling`)."""
    pooler = app[ASYNC_ENGINE].engine.pooler
    return "generate" if pooler is None else "classify" if pooler.pooling.classifies else "embed"


_IS = {"generate": "generates text", "embed": "is an embedding model",
       "classify": "is a classifier"}
_FOR = {"embed": ("embedding models", "/v1/embeddings", "not_an_embedding_model"),
        "classify": ("classifiers", "/classify", "not_a_classifier")}


def refuse_embedding_model(app: web.Application, route: str) -> None:
    """A 400 for a generation ``route`` on a model that embeds or classifies."""
    if (task := served_task(app)) != "generate":
        raise bad_request(f"the model `{app[MODEL_NAME]}` {_IS[task]}: {route} is not served; "
                          f"send the text to {_FOR[task][1]}", param="model",
                          code="embedding_model" if task == "embed" else "classification_model")


def require_task(app: web.Application, route: str, *tasks: str) -> str:
    """The served task; a 400 unless it is one of ``tasks``."""
    if (task := served_task(app)) not in tasks:
        served = " and ".join(_FOR[t][0] for t in tasks)
        settings = " or ".join(f'"{t}"' for t in tasks)
        raise bad_request(f"the model `{app[MODEL_NAME]}` {_IS[task]}: {route} is only for "
                          f"{served} (model.task = {settings})", param="model",
                          code=_FOR[tasks[0]][2])
    return task


@dataclass
class Pooled:
    """The vectors of one call's inputs, in order, and what its response names."""

    id: str
    created: int
    model: str
    vectors: list[torch.Tensor]
    usage: EmbeddingUsage


async def pool(request: web.Request, kind: str, inputs: list[list[int]], priority: int,
               adapter: str | None, token_types: list[list[int]] | None = None) -> Pooled:
    """Embed ``inputs`` (checked: `check_lengths`) as one call's engine requests, which run
    in the same steps; a failure is raised as the error the client gets. ``token_types``:
    each input's, for a model that reads them."""
    app = request.app
    params = validated(SamplingParams(max_tokens=1, priority=priority),
                       priorities=app[CONFIG].engine.scheduling_policy == "priority")
    async with Generation(request, kind, inputs, params, adapter=adapter,
                          token_types=token_types) as gen:
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        tokens = gen.num_prompt_tokens
        return Pooled(gen.id, gen.created, gen.model,
                      [gen.embeddings[p] for p in range(len(inputs))],
                      EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def check_lengths(app: web.Application, inputs: list[list[int]], field: str) -> None:
    """A 400 for the first of a request ``field``'s inputs longer than the model embeds."""
    limit = app[ASYNC_ENGINE].engine.limits.max_embedding_len
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            where = field if len(inputs) == 1 else f"{field}[{i}]"
            raise bad_request(f"`{where}` is {len(ids)} tokens; this model embeds at most "
                              f"{limit}", param=where, code="context_length_exceeded")


def encoded_inputs(app: web.Application, req, value, field: str
                   ) -> tuple[list[str], list[list[int]]]:
    """A request field's texts or token ids (as a completion's ``prompt``) as (texts, ids),
    each input truncated as ``req`` asks and checked against the model's limit."""
    texts, ids = encode_prompts(app, value, field=field)
    ids = truncate_prompts(app, ids, req, app[ASYNC_ENGINE].engine.limits.max_embedding_len)
    check_lengths(app, ids, field)
    return texts, ids


async def create_embedding(request: web.Request) -> web.Response:
    app = request.app
    require_task(app, "/v1/embeddings", "embed")
    req = await decode_body(request, EmbeddingRequest)
    adapter = check_model(app, req.model)
    engine = app[ASYNC_ENGINE].engine
    inputs = truncate_prompts(app, _inputs(app, req), req, engine.limits.max_embedding_len)
    pooling = engine.pooler.pooling
    if req.dimensions is not None:
        try:
            pooling.check_dimensions(req.dimensions, engine.runner.info.hidden_size)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from None
    check_queue_room(app, inputs, "input")
    check_lengths(app, inputs, "input")
    pooled = await pool(request, "embd", inputs, req.priority, adapter)
    data = [Embedding(index=p, embedding=_encoded(pooling.shorten(v, req.dimensions),
                                                  req.encoding_format))
            for p, v in enumerate(pooled.vectors)]
    return json_response(EmbeddingResponse(id=pooled.id, created=pooled.created,
                                           model=pooled.model, data=data, usage=pooled.usage))


def _inputs(app: web.Application, req: EmbeddingRequest) -> list[list[int]]:
    """The token ids of each input: ``input``'s, or the one of ``messages``."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("send exactly one of `input` and `messages`", param="input")
    if req.input is not None:
        return encode_prompts(app, req.input, field="input")[1]
    check_message_parts(req.messages)
    return [chat_prompt(app, req.messages, add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        add_special_tokens=req.add_special_tokens,
                        template_kwargs=req.chat_template_kwargs)]


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
