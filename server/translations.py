"""POST /v1/translations: source texts in, their translations out (translation models only).

``input`` is one text or several; ``src_lang`` / ``tgt_lang`` give one code for every input
or one per input, so one request may mix language pairs. Greedy unless ``temperature`` is
set; the whole response at once (no streaming). With ``n`` translations of each input,
translation ``i * n + j`` is input ``i``'s ``j``-th (its ``j``-th best hypothesis, with
beams).
"""

from __future__ import annotations

from aiohttp import web

from heron.core.sampling_params import SamplingParams
from heron.server.admission import beam_fields, check_beams, check_model, validated
from heron.server.appkeys import CONFIG
from heron.server.errors import decode_body
from heron.server.generation import Generation
from heron.server.limits import check_n
from heron.server.protocol import TranslationRequest
from heron.server.responses import (Translation, TranslationResponse, api_finish_reason,
                                    json_response)
from heron.server.translation_jobs import require_translation_model, translation_jobs


async def create_translation(request: web.Request) -> web.Response:
    app = request.app
    require_translation_model(app, "/v1/translations")
    req = await decode_body(request, TranslationRequest)
    adapter = check_model(app, req.model)
    texts = [req.input] if isinstance(req.input, str) else req.input
    jobs = translation_jobs(app, texts, "input", req.src_lang, req.tgt_lang, req.max_tokens)
    check_n(app[CONFIG].server, req.n)
    params = _sampling_params(req)
    check_beams(app, params)
    async with Generation(request, "trans", jobs.prompts, params, adapter=adapter,
                          encoder_prompts=jobs.sources) as gen:
        await gen.run_to_end()
        if (error := gen.failure()) is not None:
            raise error
        translations = [Translation(index=c.index, text=c.text,
                                    finish_reason=api_finish_reason(c.finish_reason))
                        for c in sorted(gen.choices.values(), key=lambda c: c.index)]
        body = TranslationResponse(id=gen.id, created=gen.created, model=gen.model,
                                   translations=translations, usage=gen.usage())
        return json_response(body)


def _sampling_params(req: TranslationRequest) -> SamplingParams:
    params = SamplingParams(n=req.n, max_tokens=req.max_tokens, min_tokens=req.min_tokens,
                            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            min_p=req.min_p, seed=req.seed,
                            repetition_penalty=req.repetition_penalty, **beam_fields(req))
    return validated(params)
