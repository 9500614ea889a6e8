"""Typed keys for what the application holds (aiohttp's `web.AppKey`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from heron.core.async_engine import AsyncEngine
from heron.core.config import Config
from heron.server.logprob_format import TokenTexts
from heron.server.metrics import Metrics
from heron.server.reasoning import ReasoningParser
from heron.server.response_background import BackgroundResponses
from heron.server.response_store import ResponseStore

CONFIG = web.AppKey("config", Config)
ASYNC_ENGINE = web.AppKey("async_engine", AsyncEngine)
METRICS = web.AppKey("metrics", Metrics)
MODEL_NAME = web.AppKey("model_name", str)
TOKEN_TEXTS = web.AppKey("token_texts", TokenTexts)
CREATED_AT = web.AppKey("created_at", int)  # unix time the model was loaded
ADAPTER_LOCK = web.AppKey("adapter_lock", asyncio.Lock)  # one adapter load/unload at a time
REASONING = web.AppKey("reasoning", ReasoningParser)  # None without server.reasoning_parser
RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
BACKGROUND = web.AppKey("background", BackgroundResponses)  # background responses running

__all__ = ["ADAPTER_LOCK", "ASYNC_ENGINE", "BACKGROUND", "CONFIG", "CREATED_AT", "METRICS",
           "MODEL_NAME", "REASONING", "RESPONSE_STORE", "TOKEN_TEXTS"]
