"""OpenAI's Responses API (/v1/responses) as msgspec Structs: the request, its input items,
the response with its output items, and the stream's events.

Input items are decoded one by one (`INPUT_ITEMS`, by ``type``; a message may leave it
out), so that an error names the item. Output items and events carry their ``type`` as a
msgspec tag.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from heron.server.protocol import SamplingFields, ToolName, _Body

Status = Literal["in_progress", "completed", "incomplete"]


# -- the request -------------------------------------------------------------------------

class TextFormat(_Body, kw_only=True):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class FunctionTool(_Body, kw_only=True):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class FunctionChoice(_Body, kw_only=True):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Body, kw_only=True):
    """``effort`` goes to the chat template as ``reasoning_effort`` (as chat's field does);
    the summaries are not written."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(SamplingFields, kw_only=True):
    """``input``: a string (one user message) or a list of items (`INPUT_ITEMS`), checked
    by the handler. vLLM's sampling fields (``top_k``, ``seed``...) apply as in chat."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as in chat
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key
    safety_identifier: str | None = None
    previous_response_id: str | None = None  # a stored response this one continues
    background: bool | None = None  # answer at once; the response runs on, polled by id
    # refused by name (see `unsupported_field`)
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def unsupported_field(self) -> str | None:
        refused = (
            ("max_tool_calls", self.max_tool_calls is not None),
            ("top_logprobs", bool(self.top_logprobs)),
            ("truncation", self.truncation == "auto"),  # never cut: a 400 when it does not fit
            ("include", any(name != "reasoning.encrypted_content" for name in self.include or ())),
            ("response_format", self.response_format is not None),  # chat's: here text.format
            ("structured_outputs", self.structured_outputs is not None),
            ("stream_options", self.stream_options is not None),
            ("n", self.n != 1))
        return next((name for name, on in refused if on), None) or super().unsupported_field()


class InputPart(_Body, kw_only=True):
    """Text in a message: the user's (``input_text``) or an earlier answer's
    (``output_text``); images and files are not served."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Any = None
    logprobs: Any = None


class MessageItem(_Body, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Body, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class ReasoningPart(_Body, kw_only=True):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body, kw_only=True):
    """An earlier answer's thinking; it reaches the template with the answer after it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


INPUT_ITEMS: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem,
                                "reasoning": ReasoningItem}


# -- the response ------------------------------------------------------------------------

class _Out(Struct, kw_only=True):
    pass


class OutputText(_Out, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(_Out, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(_Out, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class OutputReasoning(_Out, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Status


class OutputFunctionCall(_Out, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON, as the model wrote it
    status: Status


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(_Out, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(_Out, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(_Out, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseError(_Out, kw_only=True):
    code: str
    message: str


class Response(_Out, kw_only=True):
    """The request's settings come back beside the output, as OpenAI's do. ``store``: whether
    the server keeps it (`heron.server.response_store`). A background response
    (`heron.server.response_background`) is "queued", then "in_progress", then ends
    "completed", "incomplete", "failed" (with ``error``) or "cancelled"."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool = False
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float
    top_p: float
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = []
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None


class ResponseDeleted(_Out, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemsQuery(_Body, kw_only=True):
    """The query of GET /v1/responses/{id}/input_items: a page of ``limit`` items after the
    item ``after`` (by id), newest first unless ``order`` is "asc"."""

    after: str | None = None
    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


class RetrieveQuery(_Body, kw_only=True):
    """The query of GET /v1/responses/{id}: ``stream`` the events of a background response
    made with ``stream: true`` again, those after the event numbered ``starting_after``."""

    stream: bool = False
    starting_after: Annotated[int, Meta(ge=0)] | None = None


class InputItemList(_Out, kw_only=True):
    """The conversation a stored response answered: the items of the responses it continues
    (their inputs and outputs), then its own input; each with its id."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- the stream's events -----------------------------------------------------------------

class Event(_Out, kw_only=True, tag_field="type"):
    sequence_number: int = 0  # set as the event is sent


class _ResponseEvent(Event, kw_only=True):
    response: Response


class ResponseCreated(_ResponseEvent, tag="response.created"):
    pass


class ResponseQueued(_ResponseEvent, tag="response.queued"):
    pass


class ResponseInProgress(_ResponseEvent, tag="response.in_progress"):
    pass


class ResponseCompleted(_ResponseEvent, tag="response.completed"):
    pass


class ResponseIncomplete(_ResponseEvent, tag="response.incomplete"):
    pass


class ResponseFailed(_ResponseEvent, tag="response.failed"):
    pass


class _ItemEvent(Event, kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent, tag="response.output_item.added"):
    pass


class OutputItemDone(_ItemEvent, tag="response.output_item.done"):
    pass


class _InItem(Event, kw_only=True):
    """An event about a part of one output item."""

    item_id: str
    output_index: int


class _PartEvent(_InItem, kw_only=True):
    content_index: int = 0
    part: OutputText | ReasoningText


class ContentPartAdded(_PartEvent, tag="response.content_part.added"):
    pass


class ContentPartDone(_PartEvent, tag="response.content_part.done"):
    pass


class _TextDelta(_InItem, kw_only=True):
    content_index: int = 0
    delta: str


class _TextDone(_InItem, kw_only=True):
    content_index: int = 0
    text: str


class OutputTextDelta(_TextDelta, kw_only=True, tag="response.output_text.delta"):
    logprobs: list[Any] = []


class OutputTextDone(_TextDone, kw_only=True, tag="response.output_text.done"):
    logprobs: list[Any] = []


class ReasoningTextDelta(_TextDelta, tag="response.reasoning_text.delta"):
    pass


class ReasoningTextDone(_TextDone, tag="response.reasoning_text.done"):
    pass


class ArgumentsDelta(_InItem, kw_only=True, tag="response.function_call_arguments.delta"):
    delta: str


class ArgumentsDone(_InItem, kw_only=True, tag="response.function_call_arguments.done"):
    name: str
    arguments: str
