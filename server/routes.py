"""Every route of the server, on one screen."""

from __future__ import annotations

from aiohttp import web

from heron.server.anthropic_api import count_tokens, create_message
from heron.server.chat import create_chat_completion
from heron.server.classify import create_classification
from heron.server.completions import create_completion
from heron.server.embeddings import create_embedding
from heron.server.info import health, list_models, metrics, openapi, retrieve_model, version
from heron.server.lora import load_lora_adapter, unload_lora_adapter
from heron.server.responses_api import (cancel_response, create_response, delete_response,
                                        list_input_items, retrieve_response)
from heron.server.scores import create_rerank, create_score
from heron.server.tokenize import detokenize, tokenize
from heron.server.translations import create_translation


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # ids may hold "/"
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_post("/classify", create_classification)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, create_rerank)
    app.router.add_post("/v1/translations", create_translation)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
