"""Anthropic's Messages API bodies as msgspec Structs (the shapes the official client sends
and parses): requests, the message, its stream events and errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from heron.server.protocol import ToolName

# -- requests ----------------------------------------------------------------------------


class _In(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Block(_In, kw_only=True, tag_field="type"):
    cache_control: dict[str, Any] | None = None  # accepted and ignored: caching is automatic


class TextBlock(_Block, kw_only=True, tag="text"):
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block, kw_only=True, tag="tool_use"):
    """A call an earlier assistant turn made."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, kw_only=True, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block, kw_only=True, tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, kw_only=True, tag="redacted_thinking"):
    data: str


class UnservedBlock(_Block, kw_only=True, forbid_unknown_fields=False):
    """A block type this server reads no text from: refused by name."""


class ImageBlock(UnservedBlock, kw_only=True, tag="image"):
    pass


class DocumentBlock(UnservedBlock, kw_only=True, tag="document"):
    pass


Block = (TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
         | ImageBlock | DocumentBlock)


class Message(_In, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_In, kw_only=True):
    """A client tool (a function); Anthropic's server tools (web search...) are refused."""

    name: ToolName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_In, kw_only=True):
    """``auto``: the model decides; ``any``: at least one call; ``tool``: a call of ``name``;
    ``none``: no call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_In, kw_only=True):
    """To the chat template as ``enable_thinking`` (Qwen3's reads it). With a reasoning
    parser, ``budget_tokens`` caps the thinking's tokens (chat's ``thinking_token_budget``);
    without one the server cannot tell the thinking apart, and the cap is ``max_tokens``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None


class OutputFormat(_In, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_In, kw_only=True):
    """``format``: the answer is JSON matching ``schema`` (a structured output);
    ``effort``: to the chat template as ``reasoning_effort``."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class PromptFields(_In, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    # accepted and ignored: they do not change the output (caching is automatic)
    cache_control: dict[str, Any] | None = None


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    # sampling (newer clients send these in extra_body)
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    # accepted and ignored: they do not change the output
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None


class CountTokensRequest(PromptFields, kw_only=True):
    pass


# -- responses ---------------------------------------------------------------------------


class _Out(Struct, kw_only=True):
    pass


class Usage(_Out, kw_only=True):
    """``input_tokens`` leaves out those read from the prefix cache
    (``cache_read_input_tokens``), as Anthropic counts them."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class OutText(_Out, kw_only=True, tag_field="type", tag="text"):
    text: str


class OutThinking(_Out, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class OutToolUse(_Out, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutText | OutThinking | OutToolUse
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageOut(_Out, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(_Out, kw_only=True):
    input_tokens: int


class _Event(_Out, kw_only=True, tag_field="type"):
    pass


class MessageStart(_Event, kw_only=True, tag="message_start"):
    message: MessageOut


class ContentBlockStart(_Event, kw_only=True, tag="content_block_start"):
    index: int
    content_block: OutBlock


class TextDelta(_Out, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(_Out, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(_Out, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(_Event, kw_only=True, tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(_Event, kw_only=True, tag="content_block_stop"):
    index: int


class MessageDeltaBody(_Out, kw_only=True):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDelta(_Event, kw_only=True, tag="message_delta"):
    delta: MessageDeltaBody
    usage: Usage


class MessageStop(_Event, kw_only=True, tag="message_stop"):
    pass


class ErrorDetail(_Out, kw_only=True):
    type: str
    message: str


class ErrorBody(_Event, kw_only=True, tag="error"):
    """An error, answered whole or as a stream's last event."""

    error: ErrorDetail
    request_id: str | UnsetType = UNSET


Event = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
         | MessageStop | ErrorBody)
