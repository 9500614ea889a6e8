"""OpenAI response bodies as msgspec Structs (the shapes the official client parses)."""

from __future__ import annotations

from typing import Literal

import msgspec
from aiohttp import web
from msgspec import UNSET, Struct, UnsetType


class _Out(Struct, kw_only=True):
    pass


class PromptTokensDetails(_Out, kw_only=True):
    cached_tokens: int = 0


class CompletionTokensDetails(_Out, kw_only=True):
    reasoning_tokens: int = 0


class Usage(_Out, kw_only=True):
    """``completion_tokens_details``: in chat answers of a reasoning model."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


# -- /v1/completions ---------------------------------------------------------------------

class PromptLogprob(_Out, kw_only=True):
    """vLLM's shape of one token's entry in ``prompt_logprobs``."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id -> its entry,
# the prompt's own token first, then the k most likely
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(_Out, kw_only=True):
    """Parallel lists, one entry per token; the first prompt token (with ``echo``) has None."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Out, kw_only=True):
    """``prompt_token_ids`` / ``token_ids``: with ``return_token_ids`` (vLLM's), the prompt
    (streamed: in the choice's first chunk) and the output tokens (streamed: the new ones)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class CompletionResponse(_Out, kw_only=True):
    """Also each streamed chunk: same object name, ``text`` is then the new text."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions ----------------------------------------------------------------

class TopLogprob(_Out, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Out, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Out, kw_only=True):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(_Out, kw_only=True):
    name: str
    arguments: str  # JSON


class ToolCall(_Out, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDelta(_Out, kw_only=True, omit_defaults=True):
    name: str | UnsetType = UNSET  # in a call's first chunk
    arguments: str = ""  # the next piece of the JSON


class ToolCallDelta(_Out, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: its first has ``id``, ``type`` and ``function.name``."""

    index: int  # of the call in the message
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionDelta


class ChatMessageOut(_Out, kw_only=True):
    """``reasoning``: the thinking, with a reasoning parser (`heron.server.reasoning`)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None | UnsetType = UNSET
    tool_calls: list[ToolCall] = []


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_Out, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids


class ChatCompletionResponse(_Out, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET
    prompt_text: str | UnsetType = UNSET  # with return_prompt_text: the rendered template


class ChatDelta(_Out, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(_Out, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids: the new ones


class ChatCompletionChunk(_Out, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids: first chunk
    prompt_text: str | UnsetType = UNSET  # with return_prompt_text: first chunk


# -- /v1/translations --------------------------------------------------------------------

class Translation(_Out, kw_only=True):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None


class TranslationResponse(_Out, kw_only=True):
    id: str
    object: Literal["translation"] = "translation"
    created: int
    model: str
    translations: list[Translation]
    usage: Usage


# -- /v1/embeddings ----------------------------------------------------------------------

class Embedding(_Out, kw_only=True):
    """``embedding``: the floats, or (``encoding_format: "base64"``) their little-endian
    float32 bytes in base64."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Out, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class _PooledList(_Out, kw_only=True):
    """What /v1/embeddings, /classify and /score answer: a ``data`` list (each subclass's
    items) of one call's inputs."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: EmbeddingUsage


class EmbeddingResponse(_PooledList, kw_only=True):
    data: list[Embedding]


# -- /classify, /score and /rerank -------------------------------------------------------

class Classification(_Out, kw_only=True):
    index: int
    label: str  # the most probable
    probs: list[float]  # by label, in the model's order
    num_classes: int


class ClassificationResponse(_PooledList, kw_only=True):
    data: list[Classification]


class Score(_Out, kw_only=True):
    object: Literal["score"] = "score"
    index: int  # of the pair
    score: float


class ScoreResponse(_PooledList, kw_only=True):
    data: list[Score]


class RerankDocument(_Out, kw_only=True):
    text: str


class RerankResult(_Out, kw_only=True, omit_defaults=True):
    index: int  # of the document in the request
    relevance_score: float
    document: RerankDocument | None = None  # unless ``return_documents`` is false


class RerankResponse(_Out, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


# -- other routes ------------------------------------------------------------------------

class ModelCard(_Out, kw_only=True):
    """A served model. A LoRA adapter's card (vLLM's convention) has the base model's id as
    ``parent`` and the adapter's path as ``root``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "heron"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(_Out, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Out, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | UnsetType = UNSET  # with return_token_strs


class DetokenizeResponse(_Out, kw_only=True):
    prompt: str


class HealthResponse(_Out, kw_only=True):
    status: Literal["ok"] = "ok"


class VersionResponse(_Out, kw_only=True):
    version: str


class ErrorInfo(_Out, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out, kw_only=True):
    error: ErrorInfo


def encode(body: Struct) -> bytes:
    return msgspec.json.encode(body)


def json_response(body: Struct, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """``body`` as an ``application/json`` HTTP response."""
    return web.Response(status=status, body=encode(body), content_type="application/json",
                        headers=headers)


def api_finish_reason(reason: str | None) -> str | None:
    """The OpenAI finish reason for an engine one: "stop" and "length" pass, "abort" and
    "error" (which the client learns of otherwise) become None."""
    return reason if reason in ("stop", "length") else None
