"""Small read-only routes: /health, /version, /v1/models (and one by id), /metrics,
/openapi.json."""

from __future__ import annotations

from aiohttp import web

from heron.server.appkeys import ASYNC_ENGINE, CREATED_AT, METRICS, MODEL_NAME
from heron.server.errors import APIError
from heron.server.openapi import heron_version, openapi_document
from heron.server.responses import (HealthResponse, ModelCard, ModelList, VersionResponse,
                                    json_response)


async def health(request: web.Request) -> web.Response:
    """200 while the engine task runs; answered on the event loop, never behind a step."""
    async_engine = request.app[ASYNC_ENGINE]
    if async_engine.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if not async_engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_stopped")
    return json_response(HealthResponse())


async def version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(version=heron_version()))


def _model_cards(app: web.Application) -> list[ModelCard]:
    """The base model, then each LoRA adapter (``parent``: the base model, ``root``: its
    path), as vLLM lists them."""
    async_engine = app[ASYNC_ENGINE]
    engine = async_engine.engine
    base = app[MODEL_NAME]
    cards = [ModelCard(id=base, created=app[CREATED_AT], root=engine.runner.info.name,
                       max_model_len=engine.max_model_len)]
    cards += [ModelCard(id=name, created=app[CREATED_AT], root=path, parent=base,
                        max_model_len=engine.max_model_len)
              for name, path in async_engine.adapters.items() if name != base]
    return cards


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(data=_model_cards(request.app)))


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: its card, or OpenAI's 404 ``model_not_found``."""
    model = request.match_info["model"]
    card = next((c for c in _model_cards(request.app) if c.id == model), None)
    if card is None:
        raise APIError(404, f"the model `{model}` does not exist", param="model",
                       code="model_not_found")
    return json_response(card)


async def metrics(request: web.Request) -> web.Response:
    # prometheus' content type carries a version parameter that aiohttp's content_type refuses
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": request.app[METRICS].CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=openapi_document(), content_type="application/json")
