"""Fuzz: random and malformed requests never get a 5xx, and every error has OpenAI's shape.

Request bodies come from the running server's own /openapi.json: `Schemas` walks each POST
route's JSON schema into a hypothesis strategy (valid bodies, kept cheap: at most 8 tokens,
n <= 3, so hundreds of requests take seconds), and `mutated` breaks them (wrong types,
out-of-range and non-finite numbers, unknown fields, deep nesting, huge strings,
non-objects), `raw_bodies` sends bytes that are not JSON or not UTF-8, under odd
Content-Types, and `test_methods_and_paths` tries the wrong methods and unknown paths.
Hypothesis runs derandomized, so CI sees the same requests every time.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import string
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heron.core.engine import Engine
from heron.server.errors import ANTHROPIC_PREFIX
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

MODEL = "tiny"
LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
#: POST routes that take no body (an action on what the path names).
BODYLESS_POSTS = {"/v1/responses/{response_id}/cancel"}
# bounds in the valid strategy, so that each generation is a few tokens
CAPS = {"max_tokens": (1, 8), "max_completion_tokens": (1, 8), "max_output_tokens": (1, 8),
        "n": (1, 3), "min_tokens": (0, 2), "logprobs": (0, 5), "top_logprobs": (0, 5)}
ALWAYS = {"max_tokens", "max_completion_tokens", "stream"}  # sent (not null) when a route has them
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 400) | st.floats(allow_nan=False,
                                                                 allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
TOKEN_IDS = st.lists(st.integers(0, 330), min_size=1, max_size=8)  # the vocabulary is 320
# optional fields sent half the time (the other optional fields: up to four at a time)
OFTEN = {"stream", "stream_options", "echo", "logprobs", "prompt", "messages", "content"}
# a field's schema (of this kind) yields these too: values that get past the first checks
HINTS = {"model": ("string", st.just(MODEL)), "type": ("string", st.just("text")),
         "role": ("enum", st.just("user")), "prompt": ("array", TOKEN_IDS),
         "tokens": ("array", TOKEN_IDS)}
WEIRD_NUMBERS = [-1, 0, 1, 2**31, 2**63, 2**64, -2**63 - 1, 10**30, 0.5, -0.0, 1.0, 1e308,
                 5e-324, math.nan, math.inf, -math.inf]  # json.dumps writes NaN, Infinity
RAW_NUMBERS = ["1e999", "-1e999", "1E400", "00", "1.", ".5", "+1", "0x10", "1_000", "- 1"]


# -- strategies from the schema ------------------------------------------------------------

class Schemas:
    """Hypothesis strategies for the JSON schemas of one OpenAPI document."""

    def __init__(self, components: dict) -> None:
        self.components = components

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def strategy(self, schema: dict, name: str | None = None) -> st.SearchStrategy:
        schema = self.resolve(schema)
        base = self._strategy(schema, name)
        kind, hint = HINTS.get(name, (None, None))
        if hint is not None and kind == ("enum" if "enum" in schema else schema.get("type")):
            return st.one_of(hint, base)
        return base

    def _strategy(self, schema: dict, name: str | None) -> st.SearchStrategy:
        for key in ("anyOf", "oneOf"):
            if key in schema:  # never a null max_tokens: that runs to the end of the context
                options = [s for s in schema[key]
                           if not (name in ALWAYS and self.resolve(s).get("type") == "null")]
                return st.one_of([self.strategy(s, name) for s in options])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            items = self.strategy(schema["items"]) if "items" in schema else ANY_JSON
            low = schema.get("minItems", 0)
            return st.lists(items, min_size=low, max_size=min(schema.get("maxItems", 3),
                                                              max(low, 3)))
        if kind == "integer":
            low, high = schema.get("minimum"), schema.get("maximum")
            if name in CAPS:
                low = CAPS[name][0] if low is None else max(low, CAPS[name][0])
                high = CAPS[name][1] if high is None else min(high, CAPS[name][1])
            return st.integers(low, high)
        if kind == "number":
            return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                             schema.get("maximum", schema.get("exclusiveMaximum")),
                             exclude_min="exclusiveMinimum" in schema,
                             exclude_max="exclusiveMaximum" in schema,
                             allow_nan=False, allow_infinity=False)
        if kind == "string":
            low = schema.get("minLength", 0)
            return st.text(min_size=low, max_size=min(schema.get("maxLength", 16), max(low, 16)))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return ANY_JSON  # no type: any JSON value

    def _object(self, schema: dict) -> st.SearchStrategy:
        props = schema.get("properties", {})
        required = set(schema.get("required", ())) | (ALWAYS & set(props))
        fixed = {k: self.strategy(s, k) for k, s in props.items() if k in required}
        often = {k: self.strategy(s, k) for k, s in props.items() if k in OFTEN - required}
        optional = {k: self.strategy(s, k) for k, s in props.items()
                    if k not in required | OFTEN}
        extra = schema.get("additionalProperties", True)
        extra = (ANY_JSON if extra is True else self.strategy(extra)) if extra else None

        @st.composite
        def build(draw) -> dict:
            body = draw(st.fixed_dictionaries(fixed, optional=often))
            if optional:  # a few optional fields at a time, so most bodies stay valid
                for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4,
                                         unique=True)):
                    body[key] = draw(optional[key])
            if extra is not None and not props:
                body.update(draw(st.dictionaries(st.text(max_size=8), extra, max_size=3)))
            return body

        return build()


class Route:
    """A POST route: its body's object schema ($ref resolved) and valid-body strategy."""

    def __init__(self, path: str, schema: dict, valid: st.SearchStrategy) -> None:
        self.path, self.schema, self.valid = path, schema, valid

    def __repr__(self) -> str:  # hypothesis prints the fixtures of a failing example
        return f"Route({self.path!r})"

    def fields(self, kinds: set[str] | None = None) -> list[str]:
        """Top-level fields, or those whose schema admits one of ``kinds`` ("any": no type)."""
        props = self.schema.get("properties", {})
        return sorted(k for k, s in props.items()
                      if kinds is None or kinds & (set(re.findall(r'"type": "(\w+)"',
                                                                  json.dumps(s))) or {"any"}))


# -- encoding, with raw JSON text and bytes json.dumps cannot write ------------------------

_RAW = re.compile(r'"\\ue000(.*?)\\ue001"')
_BYTES = {"\\ue002": b"\xff", "\\ue003": b"\xc3\x28", "\\ue004": b"\xed\xa0\x80",
          "\\ue005": b"\\ud800", "\\ue006": b"\xf8\x88\x80\x80\x80"}


def raw(text: str) -> str:
    """A value that `encode` writes as the raw JSON text ``text``."""
    return f"\ue000{text}\ue001"


def encode(body) -> bytes:
    text = _RAW.sub(lambda m: json.loads(f'"{m[1]}"'), json.dumps(body))
    data = text.encode()
    for marker, replacement in _BYTES.items():  # inside strings: invalid UTF-8, surrogates
        data = data.replace(marker.encode(), replacement)
    return data


def nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth if kind == "list"
            else '{"a":' * depth + "1" + "}" * depth)


# -- mutations ------------------------------------------------------------------------------

def _slots(value, out: list) -> list:
    """Every (container, key) inside ``value``: nested fields and list items."""
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        out.append((value, key))
        _slots(item, out)
    return out


@st.composite
def mutated(draw, route: Route):
    """A valid body of ``route`` broken in one to three ways."""
    body = draw(route.valid)
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(body, dict):
            break
        how = draw(st.sampled_from(["wrong_type", "number", "float_for_int", "unknown",
                                    "drop", "null", "deep", "huge", "nested", "bad_string",
                                    "replace"]))
        field = draw(st.sampled_from(route.fields()))
        if how == "wrong_type":
            body[field] = draw(ANY_JSON)
        elif how == "number":
            numeric = route.fields({"integer", "number"}) or [field]
            body[draw(st.sampled_from(numeric))] = draw(
                st.sampled_from(WEIRD_NUMBERS) | st.sampled_from(RAW_NUMBERS).map(raw))
        elif how == "float_for_int":
            ints = route.fields({"integer"}) or [field]
            body[draw(st.sampled_from(ints))] = draw(st.sampled_from([1.0, 1.5, 2.0, 1e10]))
        elif how == "unknown":
            name = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in body))
            body[name] = draw(ANY_JSON)
        elif how == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif how == "null":
            body[field] = None
        elif how == "deep":
            depth = draw(st.sampled_from([30, 500, 1_000, 5_000, 20_000]))
            field = draw(st.sampled_from(route.fields({"array", "object", "any"}) or [field]))
            body[field] = raw(nested(depth, draw(st.sampled_from(["list", "dict"]))))
        elif how == "huge":  # within the 64 KiB body limit, mostly
            size = draw(st.integers(1_000, 60_000))
            body[field] = draw(st.sampled_from(["x" * size, "\u00e9\U0001f680 " * (size // 8),
                                                [7] * (size // 3), ["ab"] * (size // 5)]))
        elif how == "nested" and (slots := _slots(body, [])):
            container, key = draw(st.sampled_from(slots))
            container[key] = draw(ANY_JSON | st.sampled_from(WEIRD_NUMBERS))
        elif how == "bad_string":  # invalid UTF-8, surrogates, NUL, in a string value
            marker = draw(st.sampled_from([*sorted(_BYTES), "\\u0000"]))
            body[field] = "a" + json.loads(f'"{marker}"') + "b"
        elif how == "replace":  # not an object at all, or an empty one
            body = draw(st.sampled_from([{}, [], None, 0, "", True]) | ANY_JSON
                        | st.lists(route.valid, min_size=1, max_size=2))
    return body


@st.composite
def raw_bodies(draw, routes: dict[str, Route]):
    """(path, bytes) that are not valid JSON, or not what the route takes."""
    path = draw(st.sampled_from(sorted(routes)))
    valid = encode(draw(routes[path].valid))
    how = draw(st.sampled_from(["binary", "truncated", "trailing", "bom", "duplicate",
                                "whitespace", "text", "utf16", "latin1", "valid"]))
    if how == "binary":
        data = draw(st.binary(max_size=64))
    elif how == "truncated":
        data = valid[:draw(st.integers(0, len(valid) - 1))]
    elif how == "trailing":
        data = valid + draw(st.sampled_from([b"x", b"}", b",", b"\x00", b"{}", b"\xff"]))
    elif how == "bom":
        data = b"\xef\xbb\xbf" + valid
    elif how == "duplicate":
        data = valid[:-1] + b', "model": 5, "model": "' + MODEL.encode() + b'"}'
    elif how == "whitespace":
        data = b" \t\r\n" * draw(st.integers(1, 4_000)) + valid
    elif how == "text":
        data = draw(st.text(max_size=40)).encode("utf-8", "surrogatepass")
    elif how == "utf16":
        data = valid.decode().encode("utf-16")
    elif how == "latin1":
        data = valid.replace(b'"', b"\xe9", 1)
    else:
        data = valid
    return path, data


@st.composite
def encoded(draw, data: bytes) -> tuple[bytes, dict[str, str]]:
    """``data`` under a Content-Encoding: compressed or not, whole or cut short, or one the
    server does not take."""
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "identity", "x-bogus",
                                     "br", "zstd"]))
    if encoding is None:
        return data, {}
    if encoding in ("gzip", "deflate") and draw(st.booleans()):
        data = gzip.compress(data) if encoding == "gzip" else zlib.compress(data)
        if draw(st.booleans()):
            data = data[:len(data) // 2]
    return data, {"Content-Encoding": encoding}


CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "text/plain", "",
                                 "application/x-www-form-urlencoded", "application/json; "
                                 "charset=utf-16", "multipart/form-data; boundary=x",
                                 "application/octet-stream"])


# -- checks ---------------------------------------------------------------------------------

def assert_error_shape(payload, anthropic: bool = False) -> None:
    """OpenAI's shape; Anthropic's (``{"type": "error", "error": {"type", "message"}}``) on
    the Messages API's routes."""
    if anthropic:
        assert isinstance(payload, dict) and set(payload) == {"type", "error"}, payload
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
        assert all(isinstance(v, str) and v for v in payload["error"].values()), payload
        return
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def assert_stream(body: bytes, anthropic: bool = False) -> None:
    """Events then ``[DONE]``; Anthropic's named events, without it."""
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    assert events and (anthropic or events.pop() == "data: [DONE]"), body[-300:]
    for event in events:
        lines = event.splitlines()
        name = lines.pop(0).removeprefix("event: ") if lines[0].startswith("event: ") else None
        [line] = lines
        assert line.startswith("data: ") and line != "data: [DONE]", event
        payload = json.loads(line.removeprefix("data: "))
        if "error" in payload:
            assert_error_shape(payload, anthropic)
        if name is not None:  # a Responses API or Anthropic event: named by its type
            assert payload["type"] == name, event
        else:
            assert not anthropic, event


def check(answer: tuple[int, dict, bytes], path: str) -> int:
    """No 5xx; errors in OpenAI's shape (Anthropic's on its routes); a 200 is JSON or a
    well-formed event stream."""
    status, headers, body = answer
    anthropic = path.startswith(ANTHROPIC_PREFIX)
    assert status < 500, (status, body[:1000])
    content_type = headers.get("Content-Type", "")
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type, body[:300])
        assert_error_shape(json.loads(body), anthropic)
    else:
        assert status == 200, (status, body[:300])
        if content_type.startswith("text/event-stream"):
            assert_stream(body, anthropic)
        else:
            assert content_type.startswith("application/json"), content_type
            json.loads(body)
    return status


def idle(server) -> bool:
    m = server.metrics()
    return (m["heron_requests_running"] == 0 and m["heron_requests_waiting"] == 0
            and m["heron_kv_blocks_in_use"] == 0
            and server.async_engine.engine.num_blocks_in_use == 0)


# -- fixtures and tests ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fuzz")
    build_tiny("llama", path, std=0.15)
    config = server_config(path, **{"server.served_model_name": MODEL})
    with ServerThread(config, Engine(config)) as s:
        yield s


@pytest.fixture(scope="module")
def routes(server) -> dict[str, Route]:
    """Every POST route of /openapi.json with a JSON body (LoRA routes only when enabled)."""
    status, _, body = server.http("GET", "/openapi.json")
    assert status == 200
    doc = json.loads(body)
    schemas = Schemas(doc["components"]["schemas"])
    found = {}
    for path, operations in doc["paths"].items():
        op = operations.get("post")
        if (op is None or path in BODYLESS_POSTS
                or (path in LORA_ROUTES and not server.config.lora.allow_runtime_updates)):
            continue
        content = op.get("requestBody", {}).get("content", {})
        assert "application/json" in content, f"POST {path} publishes no JSON request schema"
        schema = schemas.resolve(content["application/json"]["schema"])
        found[path] = Route(path, schema, schemas.strategy(schema))
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(found)
    return found


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_schema_bodies(server, routes, data):
    path = data.draw(st.sampled_from(sorted(routes)), label="path")
    body = data.draw(routes[path].valid, label="body")
    check(server.http("POST", path, encode(body)), path)


@settings(FUZZ, max_examples=130)
@given(data=st.data())
def test_mutated_bodies(server, routes, data):
    path = data.draw(st.sampled_from(sorted(routes)), label="path")
    body = data.draw(mutated(routes[path]), label="body")
    content_type = data.draw(CONTENT_TYPES, label="content_type")
    check(server.http("POST", path, encode(body), {"Content-Type": content_type}), path)


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_raw_bodies(server, routes, data):
    path, body = data.draw(raw_bodies(routes), label="raw")
    body, headers = data.draw(encoded(body), label="encoded")
    headers["Content-Type"] = data.draw(CONTENT_TYPES, label="content_type")
    check(server.http("POST", path, body, headers), path)


PATH_CHARS = string.ascii_letters + string.digits + "-._~/%"


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_methods_and_paths(server, routes, data):
    method = data.draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"]))
    path = data.draw(st.sampled_from(sorted(routes) + ["/health", "/v1/models"])
                     | st.text(PATH_CHARS, max_size=20).map(lambda p: "/v1/" + p)
                     | st.text(PATH_CHARS, min_size=1, max_size=20).map(lambda p: "/" + p))
    if (method, path in routes) == ("POST", True) or (method, path) in (
            ("GET", "/health"), ("GET", "/v1/models")):
        return  # served routes with good methods: the other tests cover them
    body = data.draw(st.none() | st.just(b"{}") | st.binary(max_size=16))
    status = check(server.http(method, path, body), path)
    assert status in (404, 405), status


# -- regressions: each a bug the fuzz found -------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                              "functions": [raw(nested(5_000, "list"))]}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": "f",
                                          "parameters": {"x": raw(nested(5_000, "dict"))}}}]}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                              "chat_template_kwargs": {"x": raw(nested(5_000, "dict"))}}),
    ("/v1/completions", {"prompt": raw(nested(20_000, "list")), "max_tokens": 1}),
])
def test_deep_nesting_is_a_400(server, path, body):
    """msgspec's RecursionError was a 500."""
    status, _, answer = server.http("POST", path, encode(body))
    assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_json", answer


def test_tokenize_refuses_content_parts_that_are_not_text(server):
    """The chat template got ``text: None`` and raised a TypeError (500)."""
    for part in ({"type": "text"}, {"type": "image_url", "image_url": {"url": "http://x/y"}}):
        body = {"messages": [{"role": "user", "content": [part]}]}
        status, _, answer = server.http("POST", "/tokenize", body)
        assert status == 400, answer
        error = json.loads(answer)["error"]
        assert error["param"] == "messages[0].content[0].type", error
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert server.http("POST", "/tokenize", body)[0] == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_its_content_encoding_does_not_decode_is_a_400(server, encoding):
    """aiohttp's RequestPayloadError was a 500."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    status, _, answer = server.http("POST", "/v1/completions", body,
                                    {"Content-Encoding": encoding})
    assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_body", answer
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    status, _, answer = server.http("POST", "/v1/completions", packed,
                                    {"Content-Encoding": encoding})
    assert status == 200, answer


def test_compressed_bodies_cut_short_unknown_or_too_large_are_4xx(server):
    """aiohttp inflated bodies itself: a cut deflate stream hung the handler, br got a
    plain-text 400; and nothing bounded what a small body inflates to."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    cut = zlib.compress(body)[:-6]
    status, _, answer = server.http("POST", "/v1/completions", cut, {"Content-Encoding": "deflate"})
    assert status == 400 and json.loads(answer)["error"]["message"] == "the deflate body ends early"
    status, _, answer = server.http("POST", "/v1/completions", body, {"Content-Encoding": "br"})
    assert status == 415 and json.loads(answer)["error"]["code"] == "unsupported_encoding"
    bomb = gzip.compress(b" " * (server.config.server.max_body_bytes + 1) + body)
    status, _, answer = server.http("POST", "/v1/completions", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "server.max_body_bytes" in json.loads(answer)["error"]["message"]


def test_still_serves_and_is_idle_after_the_fuzz(server):
    """Runs after the fuzz tests (file order): nothing leaked, the engine still works."""
    server.wait_for(lambda _: idle(server), timeout_s=30)
    assert idle(server), server.metrics()
    status, _, body = server.http("POST", "/v1/completions", {
        "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
