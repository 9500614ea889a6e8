"""Translation requests for encoder-decoder models (the nllb family), for both routes that
take them (/v1/completions and /v1/translations): each input's source and decoder prompt.

A source is built as NllbTokenizer builds it: ``[src_lang] + text's tokens + [eos]``; the
decoder prompt is ``[decoder_start, tgt_lang]``, so the target code is the first decoder
token, as transformers' ``forced_bos_token_id`` forces it. The family facts come from the
runner's ``ModelInfo.extra`` (``decoder_start_token_id``, ``source_eos_token_id``,
``language_codes``; see `heron.plugins.nllb.loader`), never from hard-coded ids.

Decoder-only requests and translation requests cannot be mixed on one model: a translation
model refuses chat, a decoder-only model refuses the translation fields and route.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from heron.core.config import ConfigError, ModelConfig
from heron.core.family import ModelRunner
from heron.server.admission import tokenizer_of
from heron.server.appkeys import ASYNC_ENGINE, CONFIG, MODEL_NAME
from heron.server.errors import bad_request
from heron.server.protocol import CompletionRequest

TRANSLATION_FIELDS = ("src_lang", "tgt_lang")


@dataclass
class TranslationJobs:
    """One entry per input: the encoder's source ids and the decoder's prompt ids."""

    sources: list[list[int]]
    prompts: list[list[int]]


def is_translation_model(app: web.Application) -> bool:
    return app[ASYNC_ENGINE].engine.runner.is_encoder_decoder


def refuse_translation_fields(app: web.Application, req) -> None:
    """A decoder-only model's 400 for the first translation field ``req`` sets."""
    for name in TRANSLATION_FIELDS:
        if getattr(req, name, None) is not None:
            raise bad_request(f"`{name}` is only for translation models; `{app[MODEL_NAME]}` "
                              "is decoder-only", param=name, code="not_a_translation_model")


def require_translation_model(app: web.Application, route: str) -> None:
    if not is_translation_model(app):
        raise bad_request(f"the model `{app[MODEL_NAME]}` does not translate: {route} is only "
                          "for translation models", param="model",
                          code="not_a_translation_model")


def refuse_translation_model(app: web.Application, route: str) -> None:
    if is_translation_model(app):
        raise bad_request(f"the model `{app[MODEL_NAME]}` is a translation model: {route} is "
                          "not served; send the source text to /v1/translations or "
                          "/v1/completions", param="model", code="translation_model")


def completion_jobs(app: web.Application, req: CompletionRequest,
                    max_tokens: int | None) -> tuple[list[str], TranslationJobs]:
    """A /v1/completions request to a translation model: its source texts and jobs."""
    for name, asked in (("echo", req.echo), ("prompt_logprobs", req.prompt_logprobs is not None)):
        if asked:
            raise bad_request(f"`{name}` is not supported by translation models", param=name)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("a translation model takes `prompt` as text: a string or a list of "
                          "strings", param="prompt")
    return texts, translation_jobs(app, texts, "prompt", req.src_lang, req.tgt_lang,
                                   max_tokens)


def translation_jobs(app: web.Application, texts: list[str], param: str,
                     src_lang: str | list[str] | None, tgt_lang: str | list[str] | None,
                     max_tokens: int | None) -> TranslationJobs:
    """The sources and decoder prompts of ``texts`` (the request's field ``param``), with a
    400 naming the field for unknown or missing language codes and too long sources."""
    if not texts:
        raise bad_request(f"`{param}` must not be empty", param=param)
    runner = app[ASYNC_ENGINE].engine.runner
    facts, defaults = runner.info.extra, app[CONFIG].model
    sources_lang = _codes(facts, "src_lang", src_lang, defaults.src_lang, len(texts), param)
    targets_lang = _codes(facts, "tgt_lang", tgt_lang, defaults.tgt_lang, len(texts), param)
    tokenizer = tokenizer_of(app)
    jobs = TranslationJobs([], [])
    for i, (text, src, tgt) in enumerate(zip(texts, sources_lang, targets_lang)):
        where = param if len(texts) == 1 else f"{param}[{i}]"
        source = [src, *tokenizer.encode(text, add_special_tokens=False),
                  facts["source_eos_token_id"]]
        if len(source) > runner.max_encoder_len:
            raise bad_request(f"`{where}` is {len(source)} tokens; this model translates at most "
                              f"{runner.max_encoder_len}", param=where,
                              code="context_length_exceeded")
        jobs.sources.append(source)
        jobs.prompts.append([facts["decoder_start_token_id"], tgt])
    # the decoder's context holds its prompt (start and language tokens), then the translation
    room = app[ASYNC_ENGINE].engine.max_model_len - len(jobs.prompts[0])
    if max_tokens is not None and max_tokens > room:
        raise bad_request(f"`max_tokens` is {max_tokens}; this model translates into at most "
                          f"{room} tokens (model.max_model_len less the decoder's start and "
                          "language tokens)", param="max_tokens", code="context_length_exceeded")
    return jobs


def _codes(facts: dict, name: str, given: str | list[str] | None, default: str | None,
           count: int, param: str) -> list[int]:
    """The token id of each input's language code: ``given`` (one for all, or one per
    input), else the config's default."""
    if given is None:
        if default is None:
            raise bad_request(f"`{name}` is required: this server has no default "
                              f"(model.{name})", param=name, code="missing_language")
        return [_code_id(facts, default, f"model.{name}", name)] * count
    if isinstance(given, str):
        return [_code_id(facts, given, name, name)] * count
    if len(given) != count:
        raise bad_request(f"`{name}` has {len(given)} codes for {count} `{param}` entries: send "
                          "one code, or one per entry", param=name)
    return [_code_id(facts, code, f"{name}[{i}]", f"{name}[{i}]")
            for i, code in enumerate(given)]


def _code_id(facts: dict, code: str, where: str, param: str) -> int:
    codes: dict[str, int] = facts.get("language_codes", {})
    if code not in codes:
        shown = ", ".join(list(codes)[:5]) + (", ..." if len(codes) > 5 else "")
        raise bad_request(f"unknown language code `{code}` in `{where}` (this model has "
                          f"{len(codes)}: {shown or 'none'})", param=param,
                          code="unknown_language")
    return codes[code]


def check_language_defaults(config: ModelConfig, runner: ModelRunner) -> None:
    """At start-up: ``model.src_lang`` / ``model.tgt_lang`` are codes of a translation
    model. Raises ConfigError naming the key otherwise."""
    for name in ("src_lang", "tgt_lang"):
        code = getattr(config, name)
        if code is None:
            continue
        if not runner.is_encoder_decoder:
            raise ConfigError(f"model.{name} is set, but `{runner.info.name}` is not a "
                              "translation model")
        if code not in runner.info.extra.get("language_codes", {}):
            raise ConfigError(f"model.{name}: `{runner.info.name}` has no language code "
                              f"`{code}`")
