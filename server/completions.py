"""POST /v1/completions: prompts in, text (and logprobs) out, whole or streamed.

``echo`` prepends each prompt (and, with ``logprobs``, its prompt logprobs, the first token
having none). ``max_tokens: 0`` with ``echo`` scores the prompt without generating, the way
evaluation harnesses use the API. vLLM's ``prompt_logprobs`` puts them in each choice's
own field, in vLLM's shape, echo or not.

``num_beams`` (or vLLM's ``use_beam_search``) runs a beam search (`BeamSearchFields`). On a
translation model ``prompt`` is the source text (a string or strings) and ``src_lang`` /
``tgt_lang`` apply (`heron.server.translation_jobs`).
"""

from __future__ import annotations

from aiohttp import web
from msgspec import UNSET

from heron.server.admission import (check_beams, check_fits, check_queue_room, check_request,
                                    encode_prompts, returns_token_ids, sampling_params,
                                    truncate_prompts)
from heron.server.appkeys import ASYNC_ENGINE, TOKEN_TEXTS
from heron.server.embeddings import refuse_embedding_model
from heron.server.errors import bad_request, decode_body
from heron.server.generation import Choice, Generation
from heron.server.logprob_format import (completion_logprobs, generated_offsets,
                                         prompt_logprobs, prompt_offsets, token_id_text)
from heron.server.protocol import CompletionRequest
from heron.server.responses import (CompletionChoice, CompletionLogprobs, CompletionResponse,
                                    api_finish_reason, json_response)
from heron.server.sse import EventStream
from heron.server.translation_jobs import (completion_jobs, is_translation_model,
                                      refuse_translation_fields)


async def create_completion(request: web.Request) -> web.StreamResponse:
    req = await decode_body(request, CompletionRequest)
    adapter = check_request(request.app, req)
    refuse_embedding_model(request.app, "/v1/completions")
    score_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("`max_tokens` must be >= 1 (0 is allowed only with `echo`)",
                          param="max_tokens")
    max_tokens = 1 if score_only else req.max_tokens
    sources = None
    if is_translation_model(request.app):
        if req.truncate_prompt_tokens is not None:
            raise bad_request("`truncate_prompt_tokens` is not for translation models",
                              param="truncate_prompt_tokens")
        texts, jobs = completion_jobs(request.app, req, max_tokens)
        prompts, sources = jobs.prompts, jobs.sources
    else:
        refuse_translation_fields(request.app, req)
        texts, prompts = _prompts(request.app, req)
        check_queue_room(request.app, prompts, "prompt")
        for ids in prompts:
            check_fits(request.app, ids, max_tokens, "prompt")
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs)
             if k is not None]
    params = sampling_params(request.app, req, max_tokens=max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=max(asked, default=None))
    check_beams(request.app, params)
    view = _View(request, req, texts, prompts, score_only)
    async with Generation(request, "cmpl", prompts, params, req.cache_salt,
                          adapter=adapter, encoder_prompts=sources, scoring=score_only) as gen:
        if req.stream:
            return await view.stream(gen)
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        choices = [view.whole_choice(gen, c) for c in sorted(gen.choices.values(),
                                                                key=lambda c: c.index)]
        body = CompletionResponse(id=gen.id, created=gen.created, model=gen.model,
                                  choices=choices, usage=gen.usage())
        return json_response(body)


def _prompts(app: web.Application, req: CompletionRequest) -> tuple[list[str], list[list[int]]]:
    """The prompts' texts and token ids, cut to their last ``truncate_prompt_tokens``; a cut
    prompt's text (what ``echo`` returns) is then its kept tokens'."""
    texts, whole = encode_prompts(app, req.prompt, add_special_tokens=req.add_special_tokens)
    engine = app[ASYNC_ENGINE].engine
    prompts = truncate_prompts(app, whole, req, engine.max_model_len)
    return [text if len(ids) == len(before) or engine.tokenizer is None
            else engine.tokenizer.decode(ids, skip_special_tokens=False)
            for text, ids, before in zip(texts, prompts, whole)], prompts


class _View:
    """Builds the response shapes of one request."""

    def __init__(self, request: web.Request, req: CompletionRequest, texts: list[str],
                 prompts: list[list[int]], score_only: bool) -> None:
        self.request, self.req, self.texts, self.prompts = request, req, texts, prompts
        self.score_only = score_only
        self.tokenizer = request.app[ASYNC_ENGINE].engine.tokenizer
        self.token_ids = returns_token_ids(request.app, req)
        self.text_of = (token_id_text if req.return_tokens_as_token_ids
                        else request.app[TOKEN_TEXTS])

    def _echo(self, gen: Generation, p: int) -> tuple[str, CompletionLogprobs | None]:
        """Prompt ``p``'s text and, when logprobs were asked for, its prompt logprobs."""
        if self.req.logprobs is None:
            return self.texts[p], None
        entries = gen.prompt_logprobs.get(p, [])
        ids = self.prompts[p][:len(entries)]
        offsets = prompt_offsets(self.tokenizer, ids, self.texts[p])
        return self.texts[p], completion_logprobs(entries, self.text_of, ids, offsets,
                                                  num_top=self.req.logprobs)

    def whole_choice(self, gen: Generation, c: Choice) -> CompletionChoice:
        text, logprobs = self._echo(gen, c.prompt_index) if self.req.echo else ("", None)
        if self.req.logprobs is not None and logprobs is None:
            logprobs = CompletionLogprobs()
        if not self.score_only:
            if logprobs is not None:
                completion_logprobs(c.logprobs, self.text_of, c.token_ids,
                                    generated_offsets(c.logprobs, len(text)), logprobs)
            text += c.text
        ids = self.token_ids
        return CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                finish_reason=api_finish_reason(c.finish_reason),
                                stop_reason=None if self.score_only else c.stop_reason,
                                prompt_token_ids=self.prompts[c.prompt_index] if ids else UNSET,
                                token_ids=([] if self.score_only else c.token_ids) if ids
                                else UNSET,
                                prompt_logprobs=UNSET if self.req.prompt_logprobs is None
                                else prompt_logprobs(gen.prompt_logprobs[c.prompt_index],
                                                     self.req.prompt_logprobs, self.text_of))

    def _chunk(self, gen: Generation, choices: list[CompletionChoice]) -> CompletionResponse:
        options = self.req.stream_options
        return CompletionResponse(id=gen.id, created=gen.created, model=gen.model,
                                  choices=choices, usage=gen.usage() if options is not None
                                  and options.usage_in_every_chunk else None)

    async def stream(self, gen: Generation) -> web.StreamResponse:
        events = EventStream(self.request)
        n = gen.params.n
        starts = {c.index: 0 for c in gen.choices.values()}  # of the generated text
        unsent = {c.index for c in gen.choices.values()}  # prompt ids not sent yet
        echoed: set[int] = set()

        async def produce() -> CompletionResponse | None:
            async for p, delta in gen.deltas():
                if self.req.echo and p not in echoed and (self.req.logprobs is None
                                                          or p in gen.prompt_logprobs):
                    echoed.add(p)  # the prompt goes first, in its own event
                    text, logprobs = self._echo(gen, p)
                    ids = self.token_ids
                    echoes = [CompletionChoice(index=p * n + i, text=text, logprobs=logprobs,
                                               prompt_token_ids=self.prompts[p] if ids else UNSET,
                                               token_ids=[] if ids else UNSET)
                              for i in range(n)]
                    for choice in echoes:
                        starts[choice.index] = len(text)
                        unsent.discard(choice.index)
                    await events.send(self._chunk(gen, echoes))
                chunks = []
                for sd in delta.seqs:
                    c = gen.choices[(p, sd.index)]
                    if sd.finish_reason in ("error", "abort"):
                        await events.fail(gen.failure())
                        return None
                    text, logprobs = ("", None) if self.score_only else (sd.text, None)
                    if self.req.logprobs is not None and not self.score_only:
                        entries = sd.logprobs or []
                        logprobs = completion_logprobs(
                            entries, self.text_of, sd.token_ids,
                            generated_offsets(entries, starts[c.index]))
                    ids = sd.token_ids if self.token_ids and not self.score_only else []
                    if text or logprobs or ids or sd.finish_reason:
                        first = self.token_ids and c.index in unsent
                        unsent.discard(c.index)
                        chunks.append(CompletionChoice(
                            index=c.index, text=text, logprobs=logprobs,
                            finish_reason=api_finish_reason(sd.finish_reason),
                            stop_reason=None if self.score_only else sd.stop_reason,
                            prompt_token_ids=self.prompts[p] if first else UNSET,
                            token_ids=ids if self.token_ids else UNSET))
                if chunks:
                    await events.send(self._chunk(gen, chunks))
            if self.req.stream_options is None or not self.req.stream_options.include_usage:
                return None
            final = self._chunk(gen, [])
            final.usage = gen.usage()
            return final

        return await events.run(produce)
