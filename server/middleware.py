"""Request ids and API keys.

``X-Request-Id``: a client's id is kept (bound to every log line of the request) and echoed;
without one the server makes one. API keys: with ``server.api_keys`` or ``server.tenants``
set, every route but the open ones needs ``Authorization: Bearer <key>``; keys are compared
in constant time and never logged. A key names the request's tenant (`tenant_of`; see
`ServerConfig.key_tenants`): the prefix-cache namespace, the ``tenant`` label of per-tenant
metrics and the ``tenant`` of its log line, so that tenants never share cached KV nor see
each other's traffic.
"""

from __future__ import annotations

import hmac
import re
import time
import uuid

import structlog
from aiohttp import web

from heron.core.config import ServerConfig
from heron.server.errors import APIError

REQUEST_ID = "X-Request-Id"
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json"})
_SAFE_ID = re.compile(r"[\w.:/+=-]{1,128}")  # an id that cannot forge log lines or headers

_ID_KEY = web.RequestKey("request_id", str)
_ARRIVAL_KEY = web.RequestKey("arrival_s", float)
_TENANT = web.RequestKey("tenant", str)


def request_id_of(request: web.Request) -> str | None:
    return request.get(_ID_KEY)


def tenant_of(request: web.Request) -> str:
    """The request's tenant ("" when the server has no keys)."""
    return request.get(_TENANT, "")


def arrival_of(request: web.Request) -> float:
    """time.monotonic() when the request reached the app (TTFT and latency start here)."""
    return request.get(_ARRIVAL_KEY) or time.monotonic()


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    given = request.headers.get(REQUEST_ID, "")
    request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
    request[_ID_KEY] = request_id
    request[_ARRIVAL_KEY] = time.monotonic()
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    return await handler(request)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: also reaches streams, whose headers leave before the handler ends."""
    if _ID_KEY in request:
        response.headers[REQUEST_ID] = request[_ID_KEY]


def auth_middleware(server: ServerConfig):
    keys = [(key.encode(), tenant) for key, tenant in server.key_tenants]

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if keys and request.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if "x-api-key" in request.headers:  # Anthropic's clients send the key so
                scheme, given = "bearer", request.headers["x-api-key"]
            token = given.strip().encode()
            # NOTE: compare against every key, so the time taken says nothing about which
            tenant = None
            for key, name in keys:
                if hmac.compare_digest(token, key):
                    tenant = name
            if scheme.lower() != "bearer" or tenant is None:
                raise APIError(401, "missing or invalid API key (send Authorization: Bearer "
                               "<key>, or x-api-key: <key>)", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            request[_TENANT] = tenant
        return await handler(request)

    return check_key
