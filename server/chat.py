"""POST /v1/chat/completions: messages through the model's chat template, whole or streamed.

Streaming follows OpenAI: each choice's first chunk carries ``role: "assistant"``, later
ones the new ``content``, the last one its ``finish_reason``; with
``stream_options.include_usage`` a final chunk with no choices carries the usage (and with
vLLM's ``continuous_usage_stats`` every chunk the usage so far). Tool
calls: `heron.server.tools`; a reasoning model's thinking: `heron.server.reasoning`.
"""

from __future__ import annotations

from aiohttp import web
from msgspec import UNSET

from heron.server.admission import (chat_text, check_beams, check_fits, check_request,
                                    constrained_by, returns_token_ids, sampling_params,
                                    template_kwargs, tokenizer_of, truncate_prompts)
from heron.server.appkeys import ASYNC_ENGINE, CONFIG, REASONING, TOKEN_TEXTS
from heron.server.embeddings import refuse_embedding_model
from heron.server.errors import bad_request, decode_body
from heron.server.generation import Generation
from heron.server.logprob_format import chat_logprobs, prompt_logprobs, token_id_text
from heron.server.protocol import ChatCompletionRequest, NamedToolChoice
from heron.server.reasoning import ReasoningParser, ReasoningSplit, plan_thinking
from heron.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                    ChatMessageOut, CompletionTokensDetails, FunctionDelta,
                                    ToolCallDelta, Usage,
                                    api_finish_reason, json_response)
from heron.server.sse import EventStream
from heron.server.tools import CallHold, ToolPlan, new_call_id, plan_tools
from heron.server.translation_jobs import refuse_translation_model


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = await decode_body(request, ChatCompletionRequest)
    adapter = check_request(app, req)
    refuse_translation_model(app, "/v1/chat/completions")
    refuse_embedding_model(app, "/v1/chat/completions")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    tools = plan_tools([t.function for t in req.tools or ()], choice if named is None else None,
                       named, req.parallel_tool_calls, app[CONFIG].server.tool_call_parser,
                       constrained_by(req))
    prompt_text = chat_text(app, req.messages, add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            template_kwargs=template_kwargs(req.reasoning_effort,
                                                            req.chat_template_kwargs),
                            tools=tools.template_tools if tools else None,
                            documents=req.documents)
    tokenizer = tokenizer_of(app)
    whole = tokenizer.encode(prompt_text, add_special_tokens=req.add_special_tokens)
    prompt_ids, = truncate_prompts(app, [whole], req, app[ASYNC_ENGINE].engine.max_model_len)
    if len(prompt_ids) < len(whole):  # the text of what the model reads, as echo's
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    check_fits(app, prompt_ids, max_tokens, "messages",
               "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    params = sampling_params(app, req, max_tokens=max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             prompt_logprobs=req.prompt_logprobs,
                             tools=tools)
    check_beams(app, params)
    reasoning = app[REASONING]
    thinking = plan_thinking(reasoning, prompt_ids, params, req.thinking_token_budget)
    async with Generation(request, "chatcmpl", [prompt_ids], params, req.cache_salt,
                          adapter=adapter) as gen:
        if req.stream:
            return await _stream(request, req, gen, tools, thinking, prompt_text)
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        text_of = token_id_text if req.return_tokens_as_token_ids else app[TOKEN_TEXTS]
        bytes_of = app[TOKEN_TEXTS].bytes_of
        ids = returns_token_ids(app, req)
        echoed = _echoed(req)
        choices = []
        for c in sorted(gen.choices.values(), key=lambda c: c.index):
            thought, text = ReasoningSplit(thinking).feed(c.text, final=True)
            content, calls = tools.parse(text) if tools else (text, [])
            if echoed:
                content = echoed + (content or "")
            message = ChatMessageOut(content=content, tool_calls=calls)
            if reasoning is not None:  # as vLLM: no empty strings beside the thinking
                message.reasoning, message.content = thought or None, content or None
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=ChatLogprobs(content=chat_logprobs(c.logprobs, text_of, bytes_of))
                if req.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if ids else UNSET))
        body = ChatCompletionResponse(id=gen.id, created=gen.created, model=gen.model,
                                      choices=choices, usage=_usage(gen, reasoning, thinking),
                                      prompt_token_ids=prompt_ids if ids else UNSET,
                                      prompt_text=prompt_text if req.return_prompt_text
                                      else UNSET,
                                      prompt_logprobs=UNSET if req.prompt_logprobs is None
                                      else prompt_logprobs(gen.prompt_logprobs[0],
                                                           req.prompt_logprobs, text_of))
        return json_response(body)


def _usage(gen: Generation, parser: ReasoningParser | None, thinking: bool | None) -> Usage:
    """The usage, with the thinking's tokens when the server has a reasoning parser."""
    usage = gen.usage()
    if parser is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
            parser.thinking_tokens(c.token_ids, thinking) for c in gen.choices.values()))
    return usage


def _echoed(req: ChatCompletionRequest) -> str:
    """vLLM's ``echo``: the final message's text, when the answer continues an assistant's
    (``continue_final_message``, say), to start the answer with."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """The API's finish reason: ``tool_calls`` for an output that ended with its calls
    complete."""
    return "tool_calls" if called and reason == "stop" else api_finish_reason(reason)


async def _stream(request: web.Request, req: ChatCompletionRequest, gen: Generation,
                  tools: ToolPlan | None, thinking: bool | None,
                  prompt_text: str) -> web.StreamResponse:
    """Content streams as it comes, and so do a named call's arguments and the thinking
    (``thinking``: as `ReasoningParser.thinking` said; None: no thinking to split off);
    "auto" content streams until a call starts, and the calls come whole in the choice's
    last chunk, as do "required" ones."""
    events = EventStream(request)
    text_of = token_id_text if req.return_tokens_as_token_ids else request.app[TOKEN_TEXTS]
    bytes_of = request.app[TOKEN_TEXTS].bytes_of

    every = req.stream_options is not None and req.stream_options.usage_in_every_chunk

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=gen.id, created=gen.created, model=gen.model,
                                   choices=choices, usage=_usage(gen, request.app[REASONING],
                                                                 thinking) if every else None)

    token_ids = returns_token_ids(request.app, req)
    mode = tools.mode if tools is not None else "none"
    held: dict[int, str] = {}  # "required": choice index -> text so far
    holds: dict[int, CallHold] = {}  # "auto": choice index -> its content and calls
    call_ids: dict[int, str] = {}  # "named": choice index -> its call's id
    splits: dict[int, ReasoningSplit] = {}  # choice index -> its thinking and its answer

    async def produce() -> ChatCompletionChunk | None:
        echoed = _echoed(req)
        first = chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant",
                                                                      content=echoed))
                       for c in sorted(gen.choices.values(), key=lambda c: c.index)])
        first.prompt_token_ids = gen.prompts[0] if token_ids else UNSET
        first.prompt_text = prompt_text if req.return_prompt_text else UNSET
        await events.send(first)
        async for p, delta in gen.deltas():
            choices = []
            for sd in delta.seqs:
                if sd.finish_reason in ("error", "abort"):
                    await events.fail(gen.failure())
                    return None
                logprobs = (ChatLogprobs(content=chat_logprobs(sd.logprobs or [], text_of,
                                                               bytes_of))
                            if req.logprobs and sd.token_ids else None)
                index = gen.choices[(p, sd.index)].index
                thought, text = splits.setdefault(index, ReasoningSplit(thinking)).feed(
                    sd.text, final=sd.finish_reason is not None)
                new, finish = ChatDelta(content=text) if text else ChatDelta(), None
                if mode == "named":
                    new, finish = _named_piece(tools, call_ids, index, text, sd.finish_reason)
                elif mode == "auto":
                    hold = holds.setdefault(index, CallHold(tools.form))
                    new, finish = _auto_piece(tools, hold, text, sd.finish_reason)
                elif mode == "required":
                    held[index] = held.get(index, "") + text
                    new = ChatDelta()
                    if sd.finish_reason:
                        new, finish = _whole(tools, held.pop(index), sd.finish_reason)
                if thought:
                    new.reasoning = thought
                if new.content or new.reasoning or new.tool_calls or logprobs or (
                        sd.finish_reason or (token_ids and sd.token_ids)):
                    choices.append(ChatChunkChoice(
                        index=index, delta=new, logprobs=logprobs,
                        finish_reason=finish or api_finish_reason(sd.finish_reason),
                        stop_reason=sd.stop_reason,
                        token_ids=sd.token_ids if token_ids else UNSET))
            if choices:
                await events.send(chunk(choices))
        if req.stream_options is None or not req.stream_options.include_usage:
            return None
        final = chunk([])
        final.usage = _usage(gen, request.app[REASONING], thinking)
        return final

    return await events.run(produce)


def _named_piece(tools: ToolPlan, call_ids: dict[int, str], index: int, text: str,
                 reason: str | None) -> tuple[ChatDelta, str | None]:
    """The next piece of a named call's arguments; its first (with text, or the output's
    end) names the call."""
    first = index not in call_ids
    if not text and (not first or reason is None):
        return ChatDelta(), _finish_reason(reason, True)
    call_id = call_ids.setdefault(index, new_call_id())
    function = FunctionDelta(arguments=text)
    piece = ToolCallDelta(index=0, function=function)
    if first:
        function.name, piece.id, piece.type = tools.function, call_id, "function"
    return ChatDelta(tool_calls=[piece]), _finish_reason(reason, True)


def _auto_piece(tools: ToolPlan, hold: CallHold, text: str,
                reason: str | None) -> tuple[ChatDelta, str | None]:
    """The content of an "auto" answer as it comes (`CallHold`); its calls at its end."""
    content, calls = hold.feed(text), []
    if reason is not None:
        rest, calls = hold.end(tools)
        content += rest
    return _delta(content, calls), _finish_reason(reason, bool(calls))


def _whole(tools: ToolPlan, text: str, reason: str) -> tuple[ChatDelta, str | None]:
    content, calls = tools.parse(text)
    return _delta(content, calls), _finish_reason(reason, bool(calls))


def _delta(content: str | None, calls: list) -> ChatDelta:
    delta = ChatDelta(content=content) if content else ChatDelta()
    if calls:
        delta.tool_calls = [ToolCallDelta(index=i, id=c.id, type="function",
                                          function=FunctionDelta(name=c.function.name,
                                                                 arguments=c.function.arguments))
                            for i, c in enumerate(calls)]
    return delta
