"""POST /v1/chat/completions: messages through the model's chat template, whole or streamed.

Streaming follows OpenAI: each choice's first chunk carries ``role: "assistant"``, later
ones the new ``content``, the last one its ``finish_reason``; with
``stream_options.include_usage`` a final chunk with no choices carries the usage.
"""

from __future__ import annotations

from aiohttp import web
from msgspec import UNSET

from heron.server.admission import (chat_prompt, check_fits, check_request,
                                    returns_token_ids, sampling_params)
from heron.server.appkeys import TOKEN_TEXTS
from heron.server.errors import bad_request, decode_body
from heron.server.generation import Generation
from heron.server.logprob_format import chat_logprobs, token_id_text
from heron.server.protocol import ChatCompletionRequest
from heron.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                    ChatMessageOut, api_finish_reason, encode)
from heron.server.sse import EventStream
from heron.server.translation_jobs import refuse_translation_model


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = await decode_body(request, ChatCompletionRequest)
    adapter = check_request(app, req)
    refuse_translation_model(app, "/v1/chat/completions")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    prompt_ids = chat_prompt(app, req.messages, add_generation_prompt=req.add_generation_prompt,
                             template_kwargs=req.chat_template_kwargs)
    max_tokens = req.max_completion_tokens or req.max_tokens
    check_fits(app, prompt_ids, max_tokens, "messages",
               "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    params = sampling_params(app, req, max_tokens=max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    async with Generation(request, "chatcmpl", [prompt_ids], params, req.cache_salt,
                          adapter=adapter) as gen:
        if req.stream:
            return await _stream(request, req, gen)
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        text_of = token_id_text if req.return_tokens_as_token_ids else app[TOKEN_TEXTS]
        bytes_of = app[TOKEN_TEXTS].bytes_of
        ids = returns_token_ids(app, req)
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                              logprobs=ChatLogprobs(content=chat_logprobs(c.logprobs, text_of,
                                                                          bytes_of))
                              if req.logprobs else None,
                              finish_reason=api_finish_reason(c.finish_reason),
                              stop_reason=c.stop_reason,
                              token_ids=c.token_ids if ids else UNSET)
                   for c in sorted(gen.choices.values(), key=lambda c: c.index)]
        body = ChatCompletionResponse(id=gen.id, created=gen.created, model=gen.model,
                                      choices=choices, usage=gen.usage(),
                                      prompt_token_ids=prompt_ids if ids else UNSET)
        return web.Response(body=encode(body), content_type="application/json")


async def _stream(request: web.Request, req: ChatCompletionRequest,
                  gen: Generation) -> web.StreamResponse:
    events = EventStream(request)
    text_of = token_id_text if req.return_tokens_as_token_ids else request.app[TOKEN_TEXTS]
    bytes_of = request.app[TOKEN_TEXTS].bytes_of

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=gen.id, created=gen.created, model=gen.model,
                                   choices=choices)

    token_ids = returns_token_ids(request.app, req)

    async def produce() -> ChatCompletionChunk | None:
        first = chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant",
                                                                      content=""))
                       for c in sorted(gen.choices.values(), key=lambda c: c.index)])
        first.prompt_token_ids = gen.prompts[0] if token_ids else UNSET
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
                if sd.text or logprobs or sd.finish_reason or token_ids and sd.token_ids:
                    choices.append(ChatChunkChoice(
                        index=gen.choices[(p, sd.index)].index,
                        delta=ChatDelta(content=sd.text) if sd.text else ChatDelta(),
                        logprobs=logprobs, finish_reason=api_finish_reason(sd.finish_reason),
                        stop_reason=sd.stop_reason,
                        token_ids=sd.token_ids if token_ids else UNSET))
            if choices:
                await events.send(chunk(choices))
        if req.stream_options is None or not req.stream_options.include_usage:
            return None
        final = chunk([])
        final.usage = gen.usage()
        return final

    return await events.run(produce)
