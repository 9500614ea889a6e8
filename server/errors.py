"""Errors in OpenAI's shape, and the middleware that turns every failure into one.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status the OpenAI API (and
vLLM) would use. 500 is only for faults of the server itself, and only for the request that
met them; everything a client can cause is a 4xx that says what to fix.
"""

from __future__ import annotations

import re
import zlib

import msgspec
import structlog
from aiohttp import web

from heron.server.anthropic_protocol import ErrorBody, ErrorDetail
from heron.server.responses import ErrorInfo, ErrorResponse, json_response

log = structlog.get_logger("heron.server")

_ANTHROPIC_TYPES = {413: "request_too_large", 503: "overloaded_error"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client as is. ``param`` names the offending field."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else
                          "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def anthropic_body(self) -> ErrorBody:
        """The error in Anthropic's shape (its ``type`` names are OpenAI's where they agree)."""
        kind = _ANTHROPIC_TYPES.get(self.status,
                                    "api_error" if self.status >= 500 else self.type)
        # Anthropic's messages start with the field; ours mostly name it already
        named = self.param is None or f"`{self.param}`" in self.message
        message = self.message if named else f"{self.param}: {self.message}"
        return ErrorBody(error=ErrorDetail(type=kind, message=message))

    def response(self, anthropic: bool = False) -> web.Response:
        return json_response(self.anthropic_body() if anthropic else self.body(),
                             status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# the routes of Anthropic's Messages API, whose clients read errors in its shape
ANTHROPIC_PREFIX = "/v1/messages"

_AT = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def from_decode_error(e: msgspec.DecodeError) -> APIError:
    """A msgspec decode/validation error as a 400 whose ``param`` is the field's path."""
    text = str(e)
    # msgspec writes a mapping's value as `[...]`: the param is the mapping
    path = m[1].replace("[...]", "") if (m := _AT.search(text)) else ""
    if unknown := _UNKNOWN.search(text):
        path = f"{path}.{unknown[1]}" if path else unknown[1]
        return bad_request(f"unknown or unsupported field `{path}`", param=path,
                           code="unknown_field")
    if isinstance(e, msgspec.ValidationError):
        return bad_request(f"invalid request: {text}", param=path or None)
    return bad_request(f"the body is not valid JSON: {text}", code="invalid_json")


async def decode_body(request: web.Request, kind: type):
    """Read (413 past ``server.max_body_bytes``, compressed or not) and decode a JSON body as
    ``kind``. A gzip or deflate body is inflated here, not by aiohttp (the server runs with
    ``auto_decompress=False``): aiohttp answers a body that does not inflate with a plain
    text 400, and waits forever for the end of a truncated one."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"
    if encoding not in ("identity", "gzip", "deflate"):
        raise APIError(415, f"Content-Encoding `{encoding}` is not supported (send identity, "
                       "gzip or deflate)", code="unsupported_encoding")
    try:
        body = await request.read()
    except web.RequestPayloadError as e:
        reason = getattr(e.__cause__, "message", None) or str(e)
        raise bad_request(f"the body cannot be read: {reason}", code="invalid_body") from None
    if encoding != "identity":
        body = _inflate(body, request.client_max_size, encoding)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except RecursionError:  # msgspec stops at Python's recursion limit (~1000 levels)
        raise bad_request("the body nests arrays or objects too deeply", code="invalid_json"
                          ) from None


def _inflate(body: bytes, limit: int, encoding: str) -> bytes:
    inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)  # a gzip or a zlib header
    try:
        data = inflater.decompress(body, limit + 1)  # NOTE: a bound, against zip bombs
    except zlib.error as e:
        raise bad_request(f"the body is not valid {encoding} data: {e}",
                          code="invalid_body") from None
    if len(data) > limit:
        raise APIError(413, f"the body inflates past {limit} bytes (server.max_body_bytes)",
                       code="request_too_large")
    if not inflater.eof:
        raise bad_request(f"the {encoding} body ends early", code="invalid_body")
    return data


def _from_http(request: web.Request, e: web.HTTPException) -> APIError:
    """aiohttp's own errors (no route, wrong method, body too large) in OpenAI's shape."""
    if e.status == 404:
        return APIError(404, f"no route {request.method} {request.path}", code="not_found")
    if e.status == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.path}",
                        code="method_not_allowed", headers={"Allow": e.headers.get("Allow", "")})
    if e.status == 413:
        return APIError(413, e.text or "request body too large", code="request_too_large")
    return APIError(e.status, e.text or e.reason or "error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    anthropic = request.path.startswith(ANTHROPIC_PREFIX)
    try:
        return await handler(request)
    except APIError as e:
        return e.response(anthropic)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _from_http(request, e).response(anthropic)
    except ConnectionResetError:  # the client left; nobody reads this (nginx's "499")
        return web.Response(status=499)
    except Exception:
        log.exception("internal error", path=request.path)
        return APIError(500, "internal server error").response(anthropic)
