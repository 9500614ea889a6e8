"""The aiohttp application: `create_app(config)` and the engine's start-up/shutdown pair."""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web

from heron.core.async_engine import AsyncEngine
from heron.core.config import Config
from heron.core.engine import Engine
from heron.server.appkeys import (ADAPTER_LOCK, ASYNC_ENGINE, BACKGROUND, CONFIG, CREATED_AT,
                                  METRICS, MODEL_NAME, REASONING, RESPONSE_STORE, TOKEN_TEXTS)
from heron.server.errors import error_middleware
from heron.server.logprob_format import TokenTexts
from heron.server.metrics import Metrics
from heron.server.middleware import auth_middleware, echo_request_id, request_id_middleware
from heron.server.reasoning import reasoning_parser
from heron.server.response_background import BackgroundResponses
from heron.server.response_store import ResponseStore
from heron.server.routes import setup_routes
from heron.server.translation_jobs import check_language_defaults

log = structlog.get_logger("heron.server")


def create_app(config: Config, *, engine: Engine | None = None) -> web.Application:
    """The server for ``config``. ``engine``: an already loaded Engine to serve (tests share
    one between apps); otherwise the model loads at start-up, before the port opens."""
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[request_id_middleware, error_middleware,
                     auth_middleware(config.server)])
    app[CONFIG] = config
    app[ADAPTER_LOCK] = asyncio.Lock()
    app[RESPONSE_STORE] = ResponseStore(config.server.max_stored_responses)
    app[BACKGROUND] = BackgroundResponses()
    app.cleanup_ctx.append(_engine_context(engine))
    app.on_response_prepare.append(echo_request_id)
    setup_routes(app)
    return app


#: How the app is run (``heron serve`` and the tests): a client that hangs up cancels its
#: handler, which aborts its request in the engine before the next step; bodies are
#: inflated by `heron.server.errors.decode_body`, under the body size limit.
RUNNER_OPTIONS = {"access_log": None, "handler_cancellation": True, "auto_decompress": False}


def served_model_name(config: Config, engine: Engine) -> str:
    """``server.served_model_name``, else the model's file or directory name."""
    return config.server.served_model_name or engine.runner.info.name.removesuffix(".gguf")


def _engine_context(given: Engine | None):
    async def engine_context(app: web.Application):
        config = app[CONFIG]
        limits = {"max_waiting_requests": config.server.max_waiting_requests,
                  "max_waiting_tokens": config.server.max_waiting_tokens}
        if given is None:  # loads on the thread that will step it, the loop free meanwhile
            async_engine = await AsyncEngine.load(config, **limits)
        else:
            async_engine = AsyncEngine(given, **limits)
        engine = async_engine.engine
        check_language_defaults(config.model, engine.runner)
        app[REASONING] = reasoning_parser(config.server.reasoning_parser, engine.tokenizer)
        app[ASYNC_ENGINE] = async_engine
        app[METRICS] = Metrics(lambda: async_engine.stats)
        app[MODEL_NAME] = served_model_name(config, engine)
        app[TOKEN_TEXTS] = TokenTexts(engine.tokenizer)
        app[CREATED_AT] = int(time.time())
        async_engine.start()
        log.info("engine started", model=app[MODEL_NAME], kv_blocks=engine.num_kv_blocks,
                 kv_tokens=engine.limits.kv_capacity, max_model_len=engine.max_model_len,
                 device=str(engine.device), cpu_kernels=engine.cpu_kernels,
                 adapters=sorted(async_engine.adapters))
        if app[MODEL_NAME] in async_engine.adapters:
            log.warning("a LoRA adapter has the base model's name; that name serves the base "
                        "model", adapter=app[MODEL_NAME])
        yield
        await app[BACKGROUND].close()
        await async_engine.stop()
        log.info("engine stopped")

    return engine_context
