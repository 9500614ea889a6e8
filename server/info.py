"""Small read-only routes: /health, /v1/models, /metrics, /openapi.json."""

from __future__ import annotations

from aiohttp import web

from heron.server.appkeys import ASYNC_ENGINE, CREATED_AT, METRICS, MODEL_NAME
from heron.server.errors import APIError
from heron.server.openapi import openapi_document
from heron.server.responses import HealthResponse, ModelCard, ModelList, encode


def _json(body) -> web.Response:
    return web.Response(body=encode(body), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """200 while the engine task runs; answered on the event loop, never behind a step."""
    if not request.app[ASYNC_ENGINE].is_running:
        raise APIError(503, "the engine is not running", code="engine_stopped")
    return _json(HealthResponse())


async def list_models(request: web.Request) -> web.Response:
    app = request.app
    engine = app[ASYNC_ENGINE].engine
    card = ModelCard(id=app[MODEL_NAME], created=app[CREATED_AT], root=engine.runner.info.name,
                     max_model_len=engine.max_model_len)
    return _json(ModelList(data=[card]))


async def metrics(request: web.Request) -> web.Response:
    # prometheus' content type carries a version parameter that aiohttp's content_type refuses
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": request.app[METRICS].CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=openapi_document(), content_type="application/json")
