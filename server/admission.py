"""From a decoded request to what the engine takes: checks that name the field at fault.

Everything here raises `APIError` (400 or 404) before any engine work is queued.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from heron.core.chat_template import RESERVED_VARIABLES, ChatTemplateError
from heron.core.sampling_params import SamplingParams, StructuredOutput
from heron.server.appkeys import ASYNC_ENGINE, CONFIG, MODEL_NAME
from heron.server.errors import APIError, bad_request
from heron.server.limits import check_limits
from heron.server.protocol import ChatMessage, SamplingFields, unsupported_part
from heron.server.tools import ToolPlan


def check_request(app: web.Application, req: SamplingFields) -> str | None:
    """Refuse unsupported fields by name, fields past the ``[server]`` limits
    (`check_limits`) and models this server does not serve; the LoRA adapter the request
    names (see `check_model`)."""
    if (name := req.unsupported_field()) is not None:
        raise bad_request(f"`{name}` is not supported by this server", param=name,
                          code="unsupported_field")
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`",
                          param="stream_options")
    if getattr(req, "prompt_logprobs", None) is not None and req.stream:
        raise bad_request("`prompt_logprobs` are not available with `stream: true`",
                          param="prompt_logprobs")
    check_limits(app[CONFIG].server, req)
    return check_model(app, req.model)


def check_model(app: web.Application, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names, None for the base model (by name or no name); a
    404 for anything else. The base model's name wins over an adapter of the same name."""
    if model is None or model == app[MODEL_NAME]:
        return None
    adapters = app[ASYNC_ENGINE].adapters
    if model in adapters:
        return model
    raise APIError(404, f"the model `{model}` does not exist; this server serves "
                   f"`{app[MODEL_NAME]}`{_adapter_list(list(adapters))}", param="model",
                   code="model_not_found")


def _adapter_list(names: list[str], limit: int = 20) -> str:
    if not names:
        return ""
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f" and the LoRA adapter{'s' if len(names) > 1 else ''} {shown}{more}"


def tokenizer_of(app: web.Application):
    tokenizer = app[ASYNC_ENGINE].engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer; send token ids", code="no_tokenizer")
    return tokenizer


def encode_prompts(app: web.Application, prompt: str | list[Any], field: str = "prompt",
                   add_special_tokens: bool = True) -> tuple[list[str], list[list[int]]]:
    """A completion's ``prompt`` (string, strings, token ids, lists of token ids), or the
    request ``field`` of that shape, as (texts, token ids), one entry per prompt; texts
    with the tokenizer's special tokens unless ``add_special_tokens`` is false."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif any(type(t) is int for t in prompt):
        if not all(type(t) is int for t in prompt):
            raise bad_request(f"`{field}` mixes token ids with other values", param=field)
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise bad_request(f"`{field}` must not be empty", param=field)
    texts, ids = [], []
    vocab = app[ASYNC_ENGINE].engine.runner.info.vocab_size
    for i, item in enumerate(items):
        where = field if len(items) == 1 else f"{field}[{i}]"
        if isinstance(item, str):
            tokenizer = tokenizer_of(app)
            texts.append(item)
            ids.append(tokenizer.encode(item, add_special_tokens=add_special_tokens))
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            if (bad := next((t for t in item if not 0 <= t < vocab), None)) is not None:
                raise bad_request(f"token id {bad} in `{where}` is outside the vocabulary "
                                  f"(0..{vocab - 1})", param=where)
            tokenizer = app[ASYNC_ENGINE].engine.tokenizer
            texts.append(tokenizer.decode(item, skip_special_tokens=False) if tokenizer else "")
            ids.append(list(item))
        else:
            raise bad_request(f"`{where}` must be a string, a list of strings, a non-empty list "
                              "of token ids or a list of such lists", param=where)
        if not ids[-1]:
            raise bad_request(f"`{where}` encodes to no tokens", param=where)
    return texts, ids


def truncation_of(req, limit: int) -> int | None:
    """How many tokens vLLM's ``truncate_prompt_tokens`` of ``req`` keeps of each prompt
    (-1: ``limit``, what the model takes); None: unset, prompts stay whole, and one past the
    model's limits is then a 400 as ever. Asked for, truncation is no surprise: never
    otherwise."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        if req.truncation_side is not None:
            raise bad_request("`truncation_side` needs `truncate_prompt_tokens`",
                              param="truncation_side")
        return None
    if keep == 0 or keep > limit:
        raise bad_request(f"`truncate_prompt_tokens` is {keep}; it must be -1 (the model's "
                          f"{limit}) or from 1 to {limit}", param="truncate_prompt_tokens")
    return limit if keep == -1 else keep


def truncate_prompts(app: web.Application, prompts: list[list[int]], req,
                     limit: int) -> list[list[int]]:
    """``prompts`` cut as `truncation_of` says: each to its last tokens, its first with
    ``truncation_side: "right"``. A prompt that opens and closes with the special tokens
    the tokenizer puts around a text (``[CLS]`` ... ``[SEP]``, a BOS) keeps them, as
    transformers' and vLLM's tokenizer truncation does (`Tokenizer.truncate`)."""
    keep = truncation_of(req, limit)
    if keep is None:
        return prompts
    side = req.truncation_side or "left"
    tokenizer = app[ASYNC_ENGINE].engine.tokenizer
    if tokenizer is None:
        return [ids[:keep] if side == "right" else ids[len(ids) - keep:] for ids in prompts]
    return [tokenizer.truncate(ids, keep, side) for ids in prompts]


def check_queue_room(app: web.Application, prompts: list[list[int]], field: str) -> None:
    """A 400 for a call whose prompts (each one engine request) could never all wait at
    once: past ``server.max_waiting_requests`` or, more than one, ``max_waiting_tokens``.
    Such a call would otherwise get a 429, which clients retry, for ever."""
    limits, total = app[CONFIG].server, sum(map(len, prompts))
    if len(prompts) > limits.max_waiting_requests:
        raise bad_request(f"`{field}` has {len(prompts)} items; this server takes at most "
                          f"{limits.max_waiting_requests} (server.max_waiting_requests)",
                          param=field, code="limit_exceeded")
    if len(prompts) > 1 and total > limits.max_waiting_tokens:
        raise bad_request(f"`{field}` has {total} tokens in all; this server takes at most "
                          f"{limits.max_waiting_tokens} (server.max_waiting_tokens)",
                          param=field, code="limit_exceeded")


_CONTENT_REQUIRED = ("system", "developer", "user", "tool")  # as OpenAI's API


def check_message_parts(messages: list[ChatMessage]) -> None:
    """A 400 naming the first content part of ``messages`` this server does not serve."""
    if (name := unsupported_part(messages)) is not None:
        raise bad_request(f"`{name}` is not supported by this server", param=name,
                          code="unsupported_field")


def template_kwargs(effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables of a request: its ``chat_template_kwargs``, and its
    reasoning effort as ``reasoning_effort`` unless those set it."""
    return {**({"reasoning_effort": effort} if effort else {}), **(kwargs or {})}


def check_template_kwargs(template_kwargs: dict[str, Any] | None, given=()) -> None:
    """A 400 where a request's ``chat_template_kwargs`` set what the renderer sets itself
    or the request's own fields (``given``) set."""
    reserved = {*RESERVED_VARIABLES, "tokenize", "special_tokens", "template",
                "continue_final_message", *given}
    if clash := sorted(reserved & set(template_kwargs or ())):
        raise bad_request(f"`chat_template_kwargs` may not set {', '.join(clash)}",
                          param="chat_template_kwargs")


def chat_prompt(app: web.Application, messages: list[ChatMessage], *,
                add_special_tokens: bool = False, **render: Any) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template (`chat_text`),
    which writes any BOS itself; ``add_special_tokens`` adds the tokenizer's too, as
    vLLM's /tokenize."""
    return tokenizer_of(app).encode(chat_text(app, messages, **render),
                                    add_special_tokens=add_special_tokens)


def chat_text(app: web.Application, messages: list[ChatMessage], *,
              add_generation_prompt: bool = True, continue_final_message: bool = False,
              template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
              documents: list[dict[str, str]] | None = None) -> str:
    """``messages`` rendered with the model's chat template, with ``tools`` and
    ``documents`` (for RAG templates) as its variables of those names; with
    ``continue_final_message``, ending inside the final message, for the model to continue
    (`render_chat_template`)."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("`continue_final_message` needs `add_generation_prompt: false`: "
                          "the answer either continues the final message or starts a new one",
                          param="continue_final_message")
    plain = [_template_message(i, m) for i, m in enumerate(messages)]
    given = {name: value for name, value in (("tools", tools), ("documents", documents))
             if value}
    check_template_kwargs(template_kwargs, given)
    try:
        return tokenizer_of(app).apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}), **given)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template refused the messages: {e}",
                          param="messages") from None


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: "developer" as "system" (templates predate
    it), text parts as text, an earlier call's arguments as an object, as transformers'
    templates expect (vLLM does the same), and an earlier answer's thinking as
    ``reasoning_content`` (Qwen3's and DeepSeek's templates)."""
    if m.content is None and m.role in _CONTENT_REQUIRED:
        raise bad_request(f"`messages[{i}].content` is required in a {m.role} message",
                          param=f"messages[{i}].content")
    content = m.content if not isinstance(m.content, list) else [
        {"type": "text", "text": part.text} for part in m.content]
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": content or ""}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if reasoning := m.reasoning or m.reasoning_content:  # the name templates read
        out["reasoning_content"] = reasoning
    if m.tool_calls:
        out["tool_calls"] = [{**({"id": c.id} if c.id else {}), "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": _arguments(c.function.arguments, i, j)}}
                             for j, c in enumerate(m.tool_calls)]
    return out


def _arguments(text: str, i: int, j: int) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"`messages[{i}].tool_calls[{j}].function.arguments` is not JSON",
                          param=f"messages[{i}].tool_calls[{j}].function.arguments") from None


def check_fits(app: web.Application, prompt_ids: list[int], max_tokens: int | None,
               param: str, max_tokens_param: str = "max_tokens") -> None:
    """A 400 when the prompt (the request's field ``param``) and ``max_tokens`` (sent as
    ``max_tokens_param``) do not fit the context: never a silent truncation."""
    limit = app[ASYNC_ENGINE].engine.max_model_len
    if len(prompt_ids) >= limit:
        raise bad_request(f"`{param}` is {len(prompt_ids)} tokens; this model's context is "
                          f"{limit} tokens, leaving no room to generate", param=param,
                          code="context_length_exceeded")
    if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
        raise bad_request(f"`{param}` ({len(prompt_ids)} tokens) + `{max_tokens_param}` "
                          f"({max_tokens}) exceeds this model's context of {limit} tokens",
                          param=max_tokens_param, code="context_length_exceeded")
    # below the context when so configured
    capacity = app[ASYNC_ENGINE].engine.limits.kv_capacity
    room = capacity - len(prompt_ids)
    if room < 1:
        raise bad_request(f"`{param}` is {len(prompt_ids)} tokens; this server's KV cache "
                          f"holds {capacity} (engine.num_kv_blocks)", param=param,
                          code="context_length_exceeded")
    if (max_tokens or limit - len(prompt_ids)) > room:  # unset: up to the context's end
        sent = (f"`{max_tokens_param}` ({max_tokens})" if max_tokens
                else f"no `{max_tokens_param}` (so up to the context's end)")
        raise bad_request(f"`{param}` ({len(prompt_ids)} tokens) with {sent} may outgrow this "
                          f"server's KV cache of {capacity} tokens (engine.num_kv_blocks); "
                          f"send `{max_tokens_param}` <= {room}", param=max_tokens_param,
                          code="context_length_exceeded")


def returns_token_ids(app: web.Application, req: SamplingFields) -> bool:
    """vLLM's ``return_token_ids``; unset, on when the server has no tokenizer (the ids are
    then the only output)."""
    if req.return_token_ids is not None:
        return req.return_token_ids
    return app[ASYNC_ENGINE].engine.tokenizer is None


def check_beams(app: web.Application, params: SamplingParams) -> None:
    """A beam search needs a seat for each beam: more beams than the engine runs at once
    could never start."""
    seats = app[ASYNC_ENGINE].engine.config.engine.max_num_seqs
    if params.num_beams > seats:
        raise bad_request(f"`num_beams` is {params.num_beams}; this server runs at most "
                          f"{seats} sequences at once (engine.max_num_seqs)", param="num_beams")


def beam_fields(req) -> dict:
    """The beam-search settings a request sets; vLLM's ``use_beam_search`` runs ``n`` beams
    unless ``num_beams`` says how many."""
    fields = {name: value for name in ("num_beams", "length_penalty", "early_stopping")
              if (value := getattr(req, name, None)) is not None}
    if getattr(req, "use_beam_search", False):
        fields.setdefault("num_beams", req.n)
    return fields


def sampling_params(app: web.Application, req: SamplingFields, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None,
                    tools: ToolPlan | None = None) -> SamplingParams:
    """The engine's params for ``req``; ``structured`` (a format's grammar), or the
    ``tools``' grammar, stands in for the request's own structured output, which it
    excludes. Calls whose markers are special tokens keep special tokens in the text."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        stop=[s for s in stop if s], stop_token_ids=list(req.stop_token_ids or []),
        logit_bias=_logit_bias(req.logit_bias or {}),
        allowed_token_ids=req.allowed_token_ids,
        bad_words_token_ids=_bad_words(app, req.bad_words or []),
        structured_outputs=(tools.structured if tools else None) or structured
        or _structured(req),
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens and not (tools and tools.keeps_markers),
        speculative=req.speculative,
        priority=req.priority, **beam_fields(req))
    return validated(params, app[ASYNC_ENGINE].engine.runner.info.vocab_size,
                     priorities=app[CONFIG].engine.scheduling_policy == "priority")


def _bad_words(app: web.Application, words: list[str]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token ids: each word as it is and after a space (a word
    mid-text is most often tokenized with its space), once each."""
    if not words:
        return []
    tokenizer = tokenizer_of(app)
    spellings = (tokenizer.encode(text, add_special_tokens=False)
                 for word in words for text in (word, " " + word.lstrip()))
    return [list(ids) for ids in dict.fromkeys(map(tuple, spellings)) if ids]


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias``, keyed by token id strings, keyed by ids."""
    by_id = {}
    for key, value in bias.items():
        # only digits: int() would also take " 5", "+5", "5_0" and other scripts' digits
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids; got {key!r}",
                              param="logit_bias")
        if int(key) in by_id:
            raise bad_request(f"logit_bias names token {int(key)} twice", param="logit_bias")
        by_id[int(key)] = value
    return by_id


def constrained_by(req: SamplingFields) -> str | None:
    """The field that holds ``req``'s output to a grammar, if one does."""
    if req.structured_outputs is not None:
        return "structured_outputs"
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return None


def _structured(req: SamplingFields) -> StructuredOutput | None:
    """The request's `StructuredOutput`, from vLLM's ``structured_outputs`` or OpenAI's
    ``response_format`` (not both)."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text":
        if vllm is not None:
            raise bad_request("set `response_format` or `structured_outputs`, not both",
                              param="structured_outputs")
        if fmt.type == "json_object":
            return StructuredOutput(json={"type": "object"}, param="response_format")
        if fmt.json_schema is None:
            raise bad_request("`response_format` of type json_schema needs `json_schema`",
                              param="response_format.json_schema")
        return StructuredOutput(json=fmt.json_schema.schema or {},
                                param="response_format.json_schema.schema")
    if vllm is None:
        return None
    if vllm.json_object and vllm.json is not None:
        raise bad_request("`structured_outputs`: set json or json_object, not both",
                          param="structured_outputs")
    # `validated` checks that exactly one is set
    spec = StructuredOutput(json={"type": "object"} if vllm.json_object else vllm.json,
                            regex=vllm.regex, choice=vllm.choice, grammar=vllm.grammar)
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(spec, k) is not None]
    spec.param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return spec


def validated(params: SamplingParams, vocab_size: int | None = None,
              priorities: bool = True) -> SamplingParams:
    """``params``, or a 400 naming the field `SamplingParams.validate` refused."""
    try:
        params.validate(vocab_size, priorities)
    except ValueError as e:  # "<field> is out of range: ..."
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
    return params
