"""vLLM's POST /tokenize and POST /detokenize."""

from __future__ import annotations

from aiohttp import web
from msgspec import UNSET

from heron.server.admission import chat_prompt, check_message_parts, check_model, tokenizer_of
from heron.server.appkeys import ASYNC_ENGINE
from heron.server.errors import bad_request, decode_body
from heron.server.protocol import DetokenizeRequest, TokenizeRequest
from heron.server.responses import DetokenizeResponse, TokenizeResponse, json_response
from heron.server.tools import template_tools


async def tokenize(request: web.Request) -> web.Response:
    """Token ids of ``prompt``, or of ``messages`` through the chat template (exactly one),
    as /v1/chat/completions renders them: with ``tools`` its prompt is the one a request
    with these tools (and ``tool_choice`` other than "none") gets."""
    req = await decode_body(request, TokenizeRequest)
    check_model(request.app, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
    special = req.add_special_tokens
    tokenizer = tokenizer_of(request.app)
    if req.prompt is not None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                raise bad_request(f"`{name}` goes with `messages`, not `prompt`", param=name)
        tokens = tokenizer.encode(req.prompt, add_special_tokens=special is not False)
    else:
        check_message_parts(req.messages)
        tokens = chat_prompt(request.app, req.messages, add_special_tokens=bool(special),
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs,
                             tools=template_tools([t.function for t in req.tools])
                             if req.tools else None)
    body = TokenizeResponse(count=len(tokens), tokens=tokens,
                            max_model_len=request.app[ASYNC_ENGINE].engine.max_model_len,
                            token_strs=tokenizer.convert_ids_to_tokens(tokens)
                            if req.return_token_strs else UNSET)
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    req = await decode_body(request, DetokenizeRequest)
    check_model(request.app, req.model)
    tokenizer = tokenizer_of(request.app)
    vocab = request.app[ASYNC_ENGINE].engine.runner.info.vocab_size
    if (bad := next((t for t in req.tokens if t >= vocab), None)) is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                          param="tokens")
    body = DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))
    return json_response(body)
