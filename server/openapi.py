"""GET /openapi.json, generated from the msgspec request and response Structs."""

from __future__ import annotations

import functools
import importlib.metadata
import re

import msgspec

from heron.server import anthropic_protocol as anth
from heron.server import protocol as req
from heron.server import response_protocol as resp_api
from heron.server.errors import ANTHROPIC_PREFIX
from heron.server.middleware import OPEN_PATHS
from heron.server import responses as res

_REF = "#/components/schemas/{name}"

# (method, path, summary, request body, response body (str: plain text), streams SSE)
ROUTES = (
    ("get", "/health", "Liveness: 200 while the engine runs", None, res.HealthResponse, False),
    ("get", "/version", "The server's version", None, res.VersionResponse, False),
    ("get", "/v1/models", "The served model and its LoRA adapters", None, res.ModelList, False),
    ("get", "/v1/models/{model}", "One of them by id", None, res.ModelCard, False),
    ("post", "/v1/completions", "Text completion", req.CompletionRequest,
     res.CompletionResponse, True),
    ("post", "/v1/chat/completions", "Chat completion", req.ChatCompletionRequest,
     res.ChatCompletionResponse, True),
    ("post", "/v1/responses", "Responses API (kept for `previous_response_id` unless "
     "`store: false`)", resp_api.ResponsesRequest, resp_api.Response, True),
    ("get", "/v1/responses/{response_id}", "A stored response (`stream=true` and "
     "`starting_after` stream a background one made with `stream: true` again)", None,
     resp_api.Response, True),
    ("delete", "/v1/responses/{response_id}", "Drop a stored response", None,
     resp_api.ResponseDeleted, False),
    ("get", "/v1/responses/{response_id}/input_items", "The conversation a stored response "
     "answered, a page at a time", None, resp_api.InputItemList, False),
    ("post", "/v1/responses/{response_id}/cancel", "Stop a background response (one that "
     "ended comes back as it ended)", None, resp_api.Response, False),
    ("post", "/v1/messages", "Anthropic's Messages API (errors in its shape; the key may "
     "come as `x-api-key`)", anth.MessagesRequest, anth.MessageOut, True),
    ("post", "/v1/messages/count_tokens", "The input tokens of a Messages API request",
     anth.CountTokensRequest, anth.CountTokensResponse, False),
    ("post", "/v1/embeddings", "Embeddings (embedding models: `model.task = \"embed\"`)",
     req.EmbeddingRequest, res.EmbeddingResponse, False),
    ("post", "/classify", "Labels' probabilities (classifiers: `model.task = \"classify\"`)",
     req.ClassificationRequest, res.ClassificationResponse, False),
    *(("post", path, "Relevance of text pairs: their embeddings' cosine, or a cross-encoder's "
       "score", req.ScoreRequest, res.ScoreResponse, False) for path in ("/score", "/v1/score")),
    *(("post", path, "Documents by relevance to a query: their embeddings' cosine, or a "
       "cross-encoder's score", req.RerankRequest, res.RerankResponse, False)
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    ("post", "/v1/translations", "Translation (translation models: `src_lang` and `tgt_lang` "
     "are NLLB codes like `eng_Latn`)", req.TranslationRequest, res.TranslationResponse, False),
    ("post", "/tokenize", "Token ids of a prompt or chat", req.TokenizeRequest,
     res.TokenizeResponse, False),
    ("post", "/detokenize", "Text of token ids", req.DetokenizeRequest,
     res.DetokenizeResponse, False),
    ("post", "/v1/load_lora_adapter", "Load a LoRA adapter (with `lora.allow_runtime_updates`; "
     "`lora_path` inside `lora.allowed_dirs`)", req.LoadLoraAdapterRequest, str, False),
    ("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter; 409 while requests use it "
     "(it does not wait)", req.UnloadLoraAdapterRequest, str, False),
)


# the query parameters of routes that take some
QUERIES = {("get", "/v1/responses/{response_id}"): resp_api.RetrieveQuery,
           ("get", "/v1/responses/{response_id}/input_items"): resp_api.InputItemsQuery}


def heron_version() -> str:
    try:
        return importlib.metadata.version("heron")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _json_content(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


@functools.cache
def openapi_document() -> bytes:
    types = [t for *_, body, out, _ in ROUTES for t in (body, out) if t not in (None, str)]
    types += [res.ChatCompletionChunk, res.ErrorResponse, anth.ErrorBody, *QUERIES.values()]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    by_type = dict(zip(types, schemas))
    error = {"description": "error", "content": _json_content(by_type[res.ErrorResponse])}
    anthropic_error = {"description": "error (Anthropic's shape)",
                       "content": _json_content(by_type[anth.ErrorBody])}
    paths: dict[str, dict] = {}
    for method, path, summary, body, out, streams in ROUTES:
        content = ({"text/plain": {"schema": {"type": "string"}}} if out is str
                   else _json_content(by_type[out]))
        anthropic = path.startswith(ANTHROPIC_PREFIX)
        if streams:
            content["text/event-stream"] = {"schema": {"type": "string", "description":
                "Anthropic's named events, `message_start` to `message_stop`" if anthropic
                else "`data: <chunk JSON>` events (ChatCompletionChunk / CompletionResponse; "
                "the Responses API's named events), then `data: [DONE]`"}}
        op: dict = {"summary": summary,
                    "responses": {"200": {"description": "success", "content": content},
                                  "default": anthropic_error if anthropic else error}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": _json_content(by_type[body])}
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": {"type": "string"}} for name in re.findall(r"\{(\w+)\}", path)]
        if (query := QUERIES.get((method, path))) is not None:
            fields = components.pop(query.__name__)  # inlined: a query is not a body
            op["description"] = fields.get("description", "")
            parameters += [{"name": name, "in": "query", "required": False, "schema": schema}
                           for name, schema in fields["properties"].items()]
        if parameters:
            op["parameters"] = parameters
        if path in OPEN_PATHS:
            op["security"] = []
        paths.setdefault(path, {})[method] = op
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "security": [], "responses": {
        "200": {"description": "text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}}}
    doc = {"openapi": "3.1.0",
           "info": {"title": "heron", "version": heron_version(),
                    "description": "OpenAI-compatible LLM server"},
           # with server.api_keys or server.tenants set, every other route needs a key
           "security": [{"bearer": []}],
           "paths": paths, "components": {"schemas": components,
                                          "securitySchemes": {"bearer": {"type": "http",
                                                                         "scheme": "bearer"}}}}
    return msgspec.json.encode(doc)
