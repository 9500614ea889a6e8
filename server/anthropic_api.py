"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
machinery, for clients written against it (the ``anthropic`` SDK and the tools built on
it). The client's key may come as ``x-api-key``; errors come in Anthropic's shape.

``system`` and the ``messages`` become chat messages for the model's template: text blocks
as content, ``tool_use`` blocks as the assistant's calls, ``tool_result`` blocks as
``tool`` messages, ``thinking`` blocks as the assistant's reasoning; a final assistant
message is the answer's start, which the model continues (a prefill). ``tools`` and
``tool_choice`` (``auto``, ``any``: "required", ``tool``: a named function, ``none``) work
as in chat (`heron.server.tools`), ``output_config.format`` holds the answer to a JSON
schema, ``thinking`` reaches the template as ``enable_thinking`` (and
``output_config.effort`` as ``reasoning_effort``), and with a reasoning parser the thinking
comes back as a ``thinking`` block, capped at ``thinking.budget_tokens``. The answer is its
blocks (thinking, text, then the calls), with ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` (naming it) or ``tool_use``; a stream sends Anthropic's events: text and
thinking as they come, a named call's input as the model writes it (``input_json_delta``
pieces, as chat streams its arguments), and the other calls each whole in its block, once
the answer ends.
"""

from __future__ import annotations

import json

import msgspec
from aiohttp import web

from heron.core.sampling_params import StructuredOutput
from heron.server.admission import chat_prompt, check_fits, check_request, sampling_params
from heron.server.anthropic_protocol import (
    Block, ContentBlockDelta, ContentBlockStart, ContentBlockStop, CountTokensRequest,
    CountTokensResponse, InputJsonDelta, Message, MessageDelta, MessageDeltaBody, MessageOut,
    MessagesRequest, MessageStart, MessageStop, OutBlock, OutText, OutThinking, OutToolUse,
    PromptFields, RedactedThinkingBlock, TextBlock, TextDelta, ThinkingBlock, ThinkingDelta,
    ToolChoice, ToolResultBlock, ToolUseBlock, UnservedBlock, Usage)
from heron.server.appkeys import CONFIG, REASONING
from heron.server.embeddings import refuse_embedding_model
from heron.server.errors import APIError, bad_request, decode_body
from heron.server.generation import Choice, Generation
from heron.server.protocol import (ChatMessage, ContentPart, FunctionCall, FunctionDefinition,
                                   SamplingFields, ToolCallIn)
from heron.server.reasoning import ReasoningSplit, plan_thinking
from heron.server.responses import ToolCall, json_response
from heron.server.sse import EventStream
from heron.server.tools import CallHold, ToolPlan, new_call_id, plan_tools, template_tools
from heron.server.translation_jobs import refuse_translation_model


async def create_message(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = await decode_body(request, MessagesRequest)
    fields = SamplingFields(model=req.model, stop=req.stop_sequences, stream=req.stream,
                            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        adapter = check_request(app, fields)
    except APIError as e:  # the limits name chat's field
        if e.param and e.param.startswith("stop"):
            e.param = "stop_sequences" + e.param[len("stop"):]
            e.message = e.message.replace("`stop", "`stop_sequences", 1)
        raise
    refuse_translation_model(app, "/v1/messages")
    refuse_embedding_model(app, "/v1/messages")
    fmt = req.output_config.format if req.output_config is not None else None
    tools = _plan(app, req, "output_config.format" if fmt is not None else None)
    prompt_ids = _prompt_ids(app, req, tools.template_tools if tools else None)
    check_fits(app, prompt_ids, req.max_tokens, "messages", "max_tokens")
    params = sampling_params(app, fields, max_tokens=req.max_tokens, logprobs=None, tools=tools,
                             structured=None if fmt is None else StructuredOutput(
                                 json=fmt.schema, param="output_config.format.schema"))
    parser = app[REASONING]
    budget = (req.thinking.budget_tokens if req.thinking is not None and parser is not None
              else None)
    thinking = plan_thinking(parser, prompt_ids, params, budget)
    async with Generation(request, "msg", [prompt_ids], params, None, adapter=adapter) as gen:
        if req.stream:
            return await _stream(request, gen, tools, thinking)
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        c = gen.choices[(0, 0)]
        thought, text = ReasoningSplit(thinking).feed(c.text, final=True)
        content, calls = tools.parse(text) if tools else (text, [])
        blocks: list[OutBlock] = [OutThinking(thinking=thought)] if thought else []
        blocks += [OutText(text=content)] if content else []
        blocks += [_call_block(call) for call in calls]
        reason, sequence = _stop(c, any(isinstance(b, OutToolUse) for b in blocks))
        return json_response(MessageOut(id=gen.id, model=gen.model, content=blocks,
                                        stop_reason=reason, stop_sequence=sequence,
                                        usage=_usage(gen)))


async def count_tokens(request: web.Request) -> web.Response:
    """The input tokens a message request of these fields would have."""
    app = request.app
    req = await decode_body(request, CountTokensRequest)
    check_request(app, SamplingFields(model=req.model))
    choice = req.tool_choice
    _check_named(choice, req.tools)
    tools = (template_tools(_functions(req))
             if req.tools and (choice is None or choice.type != "none") else None)
    return json_response(CountTokensResponse(input_tokens=len(_prompt_ids(app, req, tools))))


def _functions(req: PromptFields) -> list[FunctionDefinition]:
    return [FunctionDefinition(name=t.name, description=t.description,
                               parameters=t.input_schema) for t in req.tools or ()]


def _check_named(choice: ToolChoice | None, tools: list | None) -> None:
    """A ``tool`` choice names one of ``tools``."""
    if choice is None or choice.type != "tool":
        return
    if not choice.name:
        raise bad_request('`tool_choice` of type "tool" needs `name`', param="tool_choice.name")
    if choice.name not in {t.name for t in tools or ()}:
        raise bad_request(f"`tool_choice` names the tool `{choice.name}`, which is not among "
                          "`tools`", param="tool_choice.name")


def _plan(app: web.Application, req: MessagesRequest,
          constrained_by: str | None) -> ToolPlan | None:
    choice = req.tool_choice
    _check_named(choice, req.tools)
    named = choice.name if choice is not None and choice.type == "tool" else None
    mode = None if choice is None or named else {"any": "required"}.get(choice.type,
                                                                        choice.type)
    parallel = False if choice is not None and choice.disable_parallel_tool_use else None
    return plan_tools(_functions(req), mode, named, parallel,
                      app[CONFIG].server.tool_call_parser, constrained_by)


def _prompt_ids(app: web.Application, req: PromptFields,
                tools: list[dict] | None) -> list[int]:
    kwargs = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs["reasoning_effort"] = req.output_config.effort
    # a final assistant message is the answer's start, which the model continues
    prefilled = req.messages[-1].role == "assistant"
    return chat_prompt(app, conversation(req), tools=tools,
                       add_generation_prompt=not prefilled, continue_final_message=prefilled,
                       template_kwargs={**kwargs, **(req.chat_template_kwargs or {})})


def conversation(req: PromptFields) -> list[ChatMessage]:
    """The chat messages of ``system`` and ``messages``; 400s name the block at fault."""
    messages = []
    if req.system:
        system = (req.system if isinstance(req.system, str)
                  else "\n".join(b.text for b in req.system))
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(req.messages):
        blocks = ([TextBlock(text=message.content)] if isinstance(message.content, str)
                  else message.content)
        messages += _turn(i, message, blocks)
    return messages


def _turn(i: int, message: Message, blocks: list[Block]) -> list[ChatMessage]:
    """One message's chat messages: a user's tool results (each a ``tool`` message) before
    its text; an assistant's text, reasoning and calls as one message."""
    texts, calls, results, thought = [], [], [], None
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = type(block).__struct_config__.tag
        allowed = (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
        if isinstance(block, UnservedBlock) or (
                isinstance(block, allowed) if message.role == "user"
                else isinstance(block, ToolResultBlock)):
            raise bad_request(f"`{where}.type` {kind!r} is not supported in a "
                              f"{message.role} message by this server", param=f"{where}.type",
                              code="unsupported_field")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thought = (thought or "") + block.thinking
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCallIn(id=block.id, function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif isinstance(block, ToolResultBlock):
            output = block.content if isinstance(block.content, str) else "".join(
                b.text for b in block.content or ())
            results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                       content=output))
    content = (texts[0] if len(texts) == 1
               else [ContentPart(type="text", text=t) for t in texts] if texts else None)
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content=content, tool_calls=calls or None,
                            reasoning=thought)]
    return results + ([ChatMessage(role="user", content=content)] if texts or not results
                      else [])


def _call_block(call: ToolCall) -> OutToolUse | OutText:
    """A call as a ``tool_use`` block; one whose arguments are no JSON object (a named call
    cut short by ``max_tokens``) as the text it is."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return OutText(text=call.function.arguments)
    return OutToolUse(id=call.id, name=call.function.name, input=arguments)


def _stop(c: Choice, called: bool) -> tuple[str, str | None]:
    if c.finish_reason == "length":  # a call after the complete ones may have been cut
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(gen: Generation) -> Usage:
    usage = gen.usage()
    cached = usage.prompt_tokens_details.cached_tokens
    return Usage(input_tokens=usage.prompt_tokens - cached,
                 output_tokens=usage.completion_tokens, cache_read_input_tokens=cached)


class _AnthropicEvents(EventStream):
    """Named events, errors in Anthropic's shape, and no ``[DONE]``."""

    done = None

    async def send(self, body: msgspec.Struct, event: str | None = None) -> None:
        await super().send(body, event or type(body).__struct_config__.tag)

    async def fail(self, error: APIError) -> None:
        await self.send(error.anthropic_body())
        await self.finish()


class _Blocks:
    """A stream's content blocks, each opened by its first piece and closed by the next
    block (or the end)."""

    def __init__(self, events: _AnthropicEvents) -> None:
        self.events = events
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.called = False

    async def piece(self, kind: str, piece: str) -> None:
        if not piece:
            return
        if self.open != kind:
            await self._start(OutText(text="") if kind == "text" else OutThinking(thinking=""))
        delta = TextDelta(text=piece) if kind == "text" else ThinkingDelta(thinking=piece)
        await self.events.send(ContentBlockDelta(index=self.index, delta=delta))

    async def call(self, call: ToolCall) -> None:
        block = _call_block(call)
        if isinstance(block, OutText):
            return await self.piece("text", block.text)
        await self._start(OutToolUse(id=block.id, name=block.name, input={}))
        await self.events.send(ContentBlockDelta(index=self.index, delta=InputJsonDelta(
            partial_json=json.dumps(block.input, ensure_ascii=False))))
        self.called = True
        await self.close()

    async def arguments(self, name: str, piece: str) -> None:
        """A named call's arguments as they come; the first piece opens its block."""
        if not piece:
            return
        if self.open != "tool_use":
            await self._start(OutToolUse(id=new_call_id(), name=name, input={}))
            self.called = True
        await self.events.send(ContentBlockDelta(index=self.index,
                                                 delta=InputJsonDelta(partial_json=piece)))

    async def _start(self, block: OutBlock) -> None:
        await self.close()
        self.index += 1
        self.open = type(block).__struct_config__.tag
        await self.events.send(ContentBlockStart(index=self.index, content_block=block))

    async def close(self) -> None:
        if self.open is not None:
            await self.events.send(ContentBlockStop(index=self.index))
        self.open = None


async def _stream(request: web.Request, gen: Generation, tools: ToolPlan | None,
                  thinking: bool | None) -> web.StreamResponse:
    events = _AnthropicEvents(request)
    blocks = _Blocks(events)
    split = ReasoningSplit(thinking)
    mode = tools.mode if tools is not None else "none"
    hold = CallHold(tools.form) if mode == "auto" else None
    c = gen.choices[(0, 0)]

    async def produce() -> None:
        started = False
        held = ""  # "required": the calls, parsed once whole
        async for _, delta in gen.deltas():
            if not started:  # once the prompt is scheduled: its cached tokens are known
                started = True
                start = MessageOut(id=gen.id, model=gen.model, content=[], usage=_usage(gen))
                await events.send(MessageStart(message=start))
            for sd in delta.seqs:
                if sd.finish_reason in ("error", "abort"):
                    return await events.fail(gen.failure())
                final = sd.finish_reason is not None
                thought, text = split.feed(sd.text, final=final)
                await blocks.piece("thinking", thought)
                if mode in ("none", "auto"):
                    await blocks.piece("text", hold.feed(text) if hold else text)
                elif mode == "named":  # the arguments stream as they come, as in chat
                    await blocks.arguments(tools.function, text)
                else:
                    held += text
                if not final:
                    continue
                calls = []
                if hold is not None:
                    rest, calls = hold.end(tools)
                    await blocks.piece("text", rest)
                elif mode == "required":
                    content, calls = tools.parse(held)
                    await blocks.piece("text", content or "")
                for call in calls:
                    await blocks.call(call)
                await blocks.close()
        reason, sequence = _stop(c, blocks.called)
        await events.send(MessageDelta(delta=MessageDeltaBody(
            stop_reason=reason, stop_sequence=sequence), usage=_usage(gen)))
        await events.send(MessageStop())

    return await events.run(produce)
