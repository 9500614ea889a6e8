"""/v1/responses: OpenAI's Responses API over the chat machinery.

``instructions`` and the ``input`` items become chat messages for the model's template: a
message as itself, function calls as an assistant message's ``tool_calls``, their outputs
as ``tool`` messages, and earlier thinking (``reasoning`` items) as the next assistant
message's reasoning. Tools, ``tool_choice``, ``text.format`` (structured outputs) and a
reasoning parser work as in chat (`heron.server.tools`, `heron.server.reasoning`). The
output is a ``reasoning`` item (the thinking, with a parser), then a ``message`` or the
function calls; a stream sends the events that build them (`heron.server.response_output`),
between ``response.created`` / ``response.in_progress`` and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut the output, ``response.failed``
when an error ended it).

A finished response is kept unless the request says ``store: false``
(`heron.server.response_store`): ``previous_response_id`` continues its conversation (the
earlier items come before ``input``; its ``instructions`` do not carry over, as in
OpenAI's API), ``GET`` / ``DELETE /v1/responses/{id}`` read and drop it, and ``GET
/v1/responses/{id}/input_items`` lists the conversation it answered. ``background: true``
answers at once and runs on (`heron.server.response_background`).
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web

from heron.core.sampling_params import StructuredOutput
from heron.server.admission import (chat_prompt, check_fits, check_request, sampling_params,
                                    template_kwargs)
from heron.server.appkeys import BACKGROUND, CONFIG, REASONING, RESPONSE_STORE
from heron.server.embeddings import refuse_embedding_model
from heron.server.errors import APIError, bad_request, decode_body, from_decode_error
from heron.server.generation import Choice, Generation
from heron.server.middleware import tenant_of
from heron.server.protocol import ChatMessage, ContentPart, FunctionCall, ToolCallIn
from heron.server.reasoning import ReasoningParser, ReasoningSplit, plan_thinking
from heron.server.response_background import EventLog
from heron.server.response_output import OutputBuilder
from heron.server.response_protocol import (INPUT_ITEMS, Event, FunctionCallItem,
                                            FunctionChoice,
                                            IncompleteDetails, InputItemList, InputItemsQuery,
                                            InputTokensDetails, MessageItem,
                                            OutputFunctionCall, OutputTokensDetails,
                                            ReasoningItem, Response,
                                            ResponseCompleted, ResponseCreated, ResponseDeleted,
                                            ResponseError, ResponseFailed,
                                            ResponseIncomplete, ResponseInProgress,
                                            ResponseQueued, ResponsesRequest, ResponseUsage,
                                            RetrieveQuery, TextConfig, TextFormat)
from heron.server.response_store import RUNNING, Item, ResponseStore, StoredResponse
from heron.server.responses import json_response
from heron.server.sse import EventStream
from heron.server.tools import CallHold, ToolPlan, new_call_id, plan_tools
from heron.server.translation_jobs import refuse_translation_model


async def create_response(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = await decode_body(request, ResponsesRequest)
    adapter = check_request(app, req)
    refuse_translation_model(app, "/v1/responses")
    refuse_embedding_model(app, "/v1/responses")
    store = app[RESPONSE_STORE]
    kept = req.store is not False and store.capacity > 0
    if req.background and not kept:
        raise bad_request("a background response must be stored, to be read back by id "
                          "(not `store: false`, and server.max_stored_responses > 0)",
                          param="background")
    earlier = _earlier(request, req.previous_response_id)
    messages = conversation(req, earlier)
    fmt = req.text.format if req.text is not None else None
    formatted = fmt is not None and fmt.type != "text"
    choice = req.tool_choice
    named = choice.name if isinstance(choice, FunctionChoice) else None
    tools = plan_tools(req.tools, choice if named is None else None, named,
                       req.parallel_tool_calls, app[CONFIG].server.tool_call_parser,
                       "text.format" if formatted else None)
    effort = req.reasoning.effort if req.reasoning is not None else None
    prompt_ids = chat_prompt(app, messages,
                             template_kwargs=template_kwargs(effort, req.chat_template_kwargs),
                             tools=tools.template_tools if tools else None)
    check_fits(app, prompt_ids, req.max_output_tokens, "input", "max_output_tokens")
    params = sampling_params(app, req, max_tokens=req.max_output_tokens, logprobs=None,
                             structured=_format_grammar(fmt) if formatted else None,
                             tools=tools)
    thinking = plan_thinking(app[REASONING], prompt_ids, params)
    gen = Generation(request, "resp", [prompt_ids], params, req.cache_salt, adapter=adapter,
                     background=bool(req.background))
    keep = _Keep(store, tenant_of(request), earlier) if kept else None
    answer = _Answer(req, gen, tools, app[REASONING], thinking, keep)
    if req.background:
        queued = answer.response("queued")
        await app[BACKGROUND].start((keep.tenant, gen.id), gen, answer.run_in_background)
        if answer.log is not None:
            return await _follow(request, answer.log)
        return json_response(queued)
    async with gen:
        if req.stream:
            return await _stream(request, answer)
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        c = gen.choices[(0, 0)]
        answer.feed(c.text, c.finish_reason)
        return json_response(answer.final(c).response)


async def retrieve_response(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{response_id}: a stored response of this tenant's, or a 404; with
    ``stream=true`` (`RetrieveQuery`), the events of a background one made with ``stream:
    true`` again, from ``starting_after`` on, live until it ends."""
    fields = {k: v for k, v in request.query.items()
              if k not in ("include", "include[]", "include_obfuscation")}
    try:
        query = msgspec.convert(fields, RetrieveQuery, strict=False)
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None
    stored = _stored(request)
    if not query.stream:
        return json_response(stored.response)
    if stored.events is None:
        raise bad_request(f"the response {stored.response.id!r} was not made with "
                          "`background: true` and `stream: true`: only those can be streamed "
                          "again", param="stream")
    return await _follow(request, stored.events, query.starting_after)


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}/input_items: the conversation a stored response of
    this tenant's answered, a page at a time (`InputItemsQuery`), or a 404."""
    # `include` asks for fields of image and file items, which no stored input holds
    fields = {k: v for k, v in request.query.items() if k not in ("include", "include[]")}
    try:
        query = msgspec.convert(fields, InputItemsQuery, strict=False)
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None
    stored = _stored(request)
    items = [_listed(item) for item in
             stored.conversation[:len(stored.conversation) - len(stored.response.output)]]
    if query.order == "desc":
        items.reverse()
    if query.after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == query.after), None)
        if start is None:
            raise bad_request(f"no input item of response {stored.response.id!r} has the id "
                              f"{query.after!r}", param="after")
        items = items[start:]
    page = items[:query.limit]
    listed = InputItemList(data=page, first_id=page[0]["id"] if page else None,
                           last_id=page[-1]["id"] if page else None,
                           has_more=len(items) > len(page))
    return json_response(listed)


def _listed(item: Item) -> Item:
    """A kept input item as OpenAI lists it: typed, with a status, a message's text as
    content parts (the kept item stays as it came: the template renders it so)."""
    kind = item.get("type", "message")
    out = {"type": kind, **item}
    if kind != "reasoning":
        out.setdefault("status", "completed")
    if kind == "message" and isinstance(item["content"], str):
        part = "output_text" if item["role"] == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


#: Id prefixes of the input items the server names (those that came without an id).
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                   "reasoning": "rs"}


def _named(item: Item) -> Item:
    """``item`` with an id: its own, else a new one (what input_items lists it by)."""
    if item.get("id"):
        return item
    return {**item, "id": f"{_ITEM_ID_PREFIX[item.get('type', 'message')]}_{uuid.uuid4().hex}"}


async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{response_id}/cancel: stop a background response of this tenant's;
    one that already ended comes back as it ended."""
    stored = _stored(request)
    tenant, response_id = tenant_of(request), stored.response.id
    if not stored.response.background:
        raise bad_request(f"the response {response_id!r} was not made in the background: only "
                          "a background response (`background: true`) can be cancelled")
    await request.app[BACKGROUND].cancel((tenant, response_id))
    stored = request.app[RESPONSE_STORE].get(tenant, response_id) or stored
    return json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}: drop a stored response of this tenant's (the
    responses that continue it keep their conversations), cancelling it if it still runs
    in the background."""
    tenant, response_id = tenant_of(request), request.match_info["response_id"]
    await request.app[BACKGROUND].cancel((tenant, response_id))
    if not request.app[RESPONSE_STORE].delete(tenant, response_id):
        raise _not_found(response_id)
    return json_response(ResponseDeleted(id=response_id))


def _stored(request: web.Request) -> StoredResponse:
    """The stored response of this tenant's that the path names, or a 404."""
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSE_STORE].get(tenant_of(request), response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r}",
                    code="response_not_found")


def _earlier(request: web.Request, previous_id: str | None) -> tuple[Item, ...]:
    """The conversation items of the stored response ``previous_id`` continues (none when
    it is None); a 400 when this tenant has no such response."""
    if previous_id is None:
        return ()
    stored = request.app[RESPONSE_STORE].get(tenant_of(request), previous_id)
    if stored is None:
        raise bad_request(f"Previous response with id {previous_id!r} not found (responses "
                          "sent with `store: false`, deleted ones, and the least recently "
                          "used past `server.max_stored_responses` are not kept)",
                          param="previous_response_id", code="previous_response_not_found")
    if stored.response.status in RUNNING:
        raise bad_request(f"Previous response with id {previous_id!r} is still running in the "
                          "background: continue it once it has ended",
                          param="previous_response_id", code="previous_response_running")
    return stored.conversation


@dataclass(frozen=True)
class _Keep:
    """Where a response that is stored goes, and the conversation before its input."""

    store: ResponseStore
    tenant: str
    earlier: tuple[Item, ...]


async def _stream(request: web.Request, answer: _Answer) -> web.StreamResponse:
    events = EventStream(request)
    numbers = itertools.count()

    async def send(event: Event) -> None:
        event.sequence_number = next(numbers)
        await events.send(event, event=type(event).__struct_config__.tag)

    async def produce() -> None:
        await send(ResponseCreated(response=answer.response("in_progress")))
        await send(ResponseInProgress(response=answer.response("in_progress")))
        c = answer.gen.choices[(0, 0)]
        try:
            async for _, delta in answer.gen.deltas():
                for sd in delta.seqs:
                    if sd.finish_reason not in ("error", "abort"):
                        for event in answer.feed(sd.text, sd.finish_reason):
                            await send(event)
        except APIError as e:  # past server.request_timeout_s
            await send(answer.failed(c, e))
            return None
        error = answer.gen.failure()
        await send(answer.final(c) if error is None else answer.failed(c, error))
        return None

    return await events.run(produce)


async def _follow(request: web.Request, log: EventLog,
                  after: int | None = None) -> web.StreamResponse:
    """Stream a background response's events past the one numbered ``after``, as they come,
    until it ends; the client leaving ends only this stream."""
    events = EventStream(request)

    async def produce() -> None:
        async for name, data in log.follow(after):
            await events.send_encoded(data, event=name)

    return await events.run(produce)


def _format_grammar(fmt) -> StructuredOutput:
    if fmt.type == "json_object":
        return StructuredOutput(json={"type": "object"}, param="text.format")
    if fmt.schema is None:
        raise bad_request("`text.format` of type json_schema needs `schema`",
                          param="text.format.schema")
    return StructuredOutput(json=fmt.schema, param="text.format.schema")


def input_items(req: ResponsesRequest) -> list[Item]:
    """``input`` as a list of items (a string is one user message)."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def conversation(req: ResponsesRequest, earlier: tuple[Item, ...] = ()) -> list[ChatMessage]:
    """The chat messages of ``instructions``, the ``earlier`` items of a stored conversation
    and ``input``; 400s name the item of ``input`` at fault."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    items = input_items(req)
    if not items and not messages and not earlier:
        raise bad_request("`input` must not be empty", param="input")
    thought: str | None = None  # a reasoning item's, for the assistant turn after it
    for i, raw in enumerate((*earlier, *items), start=-len(earlier)):
        item = _item(i, raw)  # earlier items were checked when they came: i >= 0 at fault
        if isinstance(item, ReasoningItem):
            thought = "".join(p.text for p in item.content or item.summary)
        elif isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else [
                ContentPart(type="text", text=part.text) for part in item.content]
            messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            _check_arguments(i, item.arguments)  # here, to name the item (chat's would not)
            call = ToolCallIn(id=item.call_id, function=FunctionCall(name=item.name,
                                                                     arguments=item.arguments))
            last = messages[-1] if messages else None
            if (last is not None and last.role == "assistant"
                    and (last.tool_calls or thought is None)):
                last.tool_calls = [*(last.tool_calls or ()), call]  # one turn, several calls
                continue
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            output = item.output if isinstance(item.output, str) else "".join(
                part.text for part in item.output)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
        if thought is not None and messages and messages[-1].role == "assistant":
            messages[-1].reasoning, thought = thought, None
    return messages


def _check_arguments(i: int, arguments: str) -> None:
    try:
        json.loads(arguments)
    except ValueError:
        raise bad_request(f"`input[{i}].arguments` is not JSON",
                          param=f"input[{i}].arguments") from None


def _item(i: int, raw: dict):
    kind = raw.get("type", "message")
    if not isinstance(kind, str) or kind not in INPUT_ITEMS:
        raise bad_request(f"`input[{i}].type` {kind!r} is not supported by this server (it "
                          f"takes {', '.join(INPUT_ITEMS)})", param=f"input[{i}].type",
                          code="unsupported_field")
    try:
        return msgspec.convert(raw, INPUT_ITEMS[kind])
    except msgspec.ValidationError as e:
        error = from_decode_error(e)
        error.param = f"input[{i}]" + (f".{error.param}" if error.param else "")
        error.message = error.message.replace("$", f"$.input[{i}]", 1)
        raise error from None


class _Answer:
    """One response's output as the engine's text comes: the thinking split off, the
    answer as a message or as function calls (`OutputBuilder`)."""

    def __init__(self, req: ResponsesRequest, gen: Generation, tools: ToolPlan | None,
                 parser: ReasoningParser | None, thinking: bool | None,
                 keep: _Keep | None) -> None:
        self.req, self.gen, self.tools, self.keep = req, gen, tools, keep
        self.parser, self.thinking = parser, thinking
        self.split = ReasoningSplit(thinking)
        self.mode = tools.mode if tools is not None else "none"
        self.output = OutputBuilder()
        self.held = ""  # "required": the answer, parsed once whole
        # "auto": the content as it comes, the calls once whole
        self.hold = CallHold(tools.form) if self.mode == "auto" else None
        self.call_id = new_call_id()  # "named": the one call
        # named once: a background response is kept at each state under the same ids
        self.inputs = tuple(_named(item) for item in input_items(req))
        self.log = EventLog() if req.background and req.stream else None

    def feed(self, text: str, finish_reason: str | None) -> list[Event]:
        """The events of the output's next ``text``; the last piece has its finish reason."""
        thought, text = self.split.feed(text, final=finish_reason is not None)
        events = self.output.reasoning(thought)
        if self.mode == "none":
            events += self.output.message(text)
        elif self.mode == "named":
            if text:
                events += self.output.call(self.call_id, self.tools.function, text)
        elif self.mode == "auto":
            events += self.output.message(self.hold.feed(text))
        else:
            self.held += text
        if finish_reason is None:
            return events
        calls = []
        if self.mode == "named" and not any(isinstance(item, OutputFunctionCall)
                                            for item in self.output.items):
            events += self.output.call(self.call_id, self.tools.function, "")  # no arguments
        elif self.mode == "auto":
            rest, calls = self.hold.end(self.tools)
            events += self.output.message(rest)
        elif self.mode == "required":
            content, calls = self.tools.parse(self.held)
            events += self.output.message(content or "")
        for call in calls:
            events += self.output.call(call.id, call.function.name, call.function.arguments)
        return events + self.output.close("incomplete" if finish_reason == "length"
                                          else "completed")

    def final(self, c: Choice) -> ResponseCompleted | ResponseIncomplete:
        """The last event: the whole response, once ``c`` (its one choice) finished; stored
        with its conversation (the earlier items, ``input``, the output) when it is kept."""
        status = "incomplete" if c.finish_reason == "length" else "completed"
        response = self.response(status, self._usage(c))
        self._keep(response)
        if status == "incomplete":
            return ResponseIncomplete(response=response)
        return ResponseCompleted(response=response)

    async def run_in_background(self) -> None:
        """A background response from "queued" to its end, each state kept as it is
        reached, its events logged when it streams (`heron.server.response_background`).
        A cancelled one's stream ends without a last event (GET shows it "cancelled")."""
        try:
            await self._run_in_background()
        finally:
            if self.log is not None:
                self.log.close()

    async def _run_in_background(self) -> None:
        queued = self.response("queued")
        self._keep(queued)
        self._log(ResponseCreated(response=queued), ResponseQueued(response=queued))
        c = self.gen.choices[(0, 0)]
        started = False
        try:
            async for _, delta in self.gen.deltas():
                if not started:
                    started = True
                    running = self.response("in_progress")
                    self._keep(running)
                    self._log(ResponseInProgress(response=running))
                for sd in delta.seqs:
                    if sd.finish_reason not in ("error", "abort"):
                        self._log(*self.feed(sd.text, sd.finish_reason))
        except APIError as e:  # past server.request_timeout_s
            self._log(self.failed(c, e))
            return
        if self.gen.cancelled and c.finish_reason in (None, "abort"):  # not ended by itself
            self._keep(self.response("cancelled", self._usage(c)))
        elif (error := self.gen.failure()) is not None:
            self._log(self.failed(c, error))
        else:
            self._log(self.final(c))

    def failed(self, c: Choice, error: APIError) -> ResponseFailed:
        """The last event of a response that ``error`` ended, kept as it ended."""
        failed = self.response("failed", self._usage(c), error=error)
        self._keep(failed)
        return ResponseFailed(response=failed)

    def _log(self, *events: Event) -> None:
        if self.log is not None:
            for event in events:
                self.log.add(event)

    def _keep(self, response: Response) -> None:
        """Store ``response`` with its conversation (the earlier items, ``input``, the
        output), when it is kept."""
        if self.keep is not None:
            output = tuple(msgspec.to_builtins(item) for item in response.output)
            self.keep.store.put(self.keep.tenant, StoredResponse(
                response, (*self.keep.earlier, *self.inputs, *output), self.log))

    def _usage(self, c: Choice) -> ResponseUsage:
        usage = self.gen.usage()
        thinking = self.parser.thinking_tokens(c.token_ids, self.thinking) if self.parser else 0
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=thinking),
            total_tokens=usage.total_tokens)

    def response(self, status: str, usage: ResponseUsage | None = None,
                 error: APIError | None = None) -> Response:
        req = self.req
        choice = req.tool_choice
        return Response(
            id=self.gen.id, created_at=self.gen.created, status=status,
            background=bool(req.background), model=self.gen.model,
            output=list(self.output.items), usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None,
            error=None if error is None else ResponseError(code=error.code or error.type,
                                                           message=error.message),
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature, top_p=req.top_p,
            tool_choice=choice if choice is not None else ("auto" if req.tools else "none"),
            tools=req.tools or [], text=req.text or TextConfig(format=TextFormat(type="text")),
            reasoning=req.reasoning, metadata=req.metadata, user=req.user,
            previous_response_id=req.previous_response_id, store=self.keep is not None)
