"""Rendering Hugging Face chat templates (jinja2), the way `transformers` renders them.

Chat templates come from model files, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, with the globals and filters transformers provides
(`raise_exception`, `tojson` that does not HTML-escape, `strftime_now`, `dict`, `namespace`,
loop controls, and the `{% generation %}` block tag, rendered as its body). With the same
template, messages and special tokens, `render_chat_template` returns the string
`transformers`' `apply_chat_template(..., tokenize=False)` returns.

Differences on purpose: message ``content`` given as a list of OpenAI-style parts
(``[{"type": "text", "text": ...}]``) is joined into one string (parts separated by
``"\\n"``, as vLLM does for string-format templates), since most templates only handle
strings; a part of any other type is an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "normalize_messages", "placeholder_template",
           "read_chat_template", "render_chat_template"]


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered: no template, a bad message, or the template
    itself refused it (``raise_exception``). A ValueError, so servers answer 400."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for serving only its body matters, but the tag must still parse."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as transformers' does (sandbox hygiene)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _DictFactory:
    """`dict(...)` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would corrupt tool schemas in prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Names a request's template variables may not take: what `render_chat_template` sets itself
# and the functions templates call (a variable of that name would replace the function)
_OWN_GLOBALS = ("raise_exception", "strftime_now", "dict", "namespace")
RESERVED_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", *jinja2.defaults.DEFAULT_NAMESPACE, *_OWN_GLOBALS})


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc


def read_chat_template(value: str) -> str:
    """The template ``model.chat_template`` gives: the text itself where it holds Jinja
    markup (``{{`` or ``{%``), else the file it names (as vLLM's ``--chat-template``).
    Raises `ChatTemplateError` for a file that is not there or a template that does not
    parse, so that a server refuses to start rather than every chat request."""
    if "{{" in value or "{%" in value:
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ChatTemplateError(f"model.chat_template: {value!r} is neither a file nor a "
                                    "Jinja template")
        text = path.read_text(encoding="utf-8")
    try:
        _compile(text)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"model.chat_template: {e.__cause__}") from None
    return text


def placeholder_template(text: str) -> str:
    """A score template (messages of roles "query" and "document") that writes ``text``
    with its ``{query}`` and ``{document}`` replaced by theirs, as llama.cpp's rerank
    templates (a GGUF's ``tokenizer.chat_template.rerank``) are filled in. The rest of
    ``text`` is written as it is: Jinja string literals, which no markup in it can open."""
    def literal(piece: str) -> str:
        return "{{ %s }}" % json.dumps(piece, ensure_ascii=False) if piece else ""

    out = []
    for i, chunk in enumerate(text.split("{query}")):
        if i:
            out.append('{{ (messages | selectattr("role", "equalto", "query") | first).content }}')
        for j, piece in enumerate(chunk.split("{document}")):
            if j:
                out.append('{{ (messages | selectattr("role", "equalto", "document") '
                           '| first).content }}')
            out.append(literal(piece))
    return "".join(out)


def _plain(value: Any) -> Any:
    """A copy built of plain JSON-like types only, so the sandbox never sees foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # Subclasses (enums, numpy scalars...) carry methods the sandbox does not know: strip them.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _join_text_parts(parts: Sequence[Any], index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type", "text") != "text" or "text" not in part:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"messages[{index}].content: unsupported content part {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of ``messages``: keys whose value is None dropped (as transformers
    does: many templates print a literal "None" otherwise), text-part lists joined."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        msg = {k: _plain(v) for k, v in message.items() if v is not None}
        if isinstance(msg.get("content"), list):
            msg["content"] = _join_text_parts(msg["content"], i)
        out.append(msg)
    return out


# marks where the final message's content ends, for `continue_final_message`; the space
# shows whether the template stripped the content's end
_CONTINUE_MARK = "\u2063heron-continue\u2063 "


def render_chat_template(template: str | None, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         special_tokens: Mapping[str, str | None] | None = None,
                         **kwargs: Any) -> str:
    """Render ``messages`` with ``template``.

    ``special_tokens`` become template variables (``bos_token``, ``eos_token``, ...), as the
    tokenizer's special-tokens map does in transformers; ``kwargs`` (e.g. ``tools``,
    ``enable_thinking``) are passed through and override them. With
    ``continue_final_message`` the text ends where the last message's content does (what
    the template writes after it, the end of its turn, is cut), so that the model continues
    that message, as transformers' option of the same name does. Raises `ChatTemplateError`
    when ``template`` is None, a kwarg is one of `RESERVED_VARIABLES`, or the template
    raises.
    """
    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use the completions API or give it one "
            "(model.chat_template, `heron serve --chat-template FILE`)")
    if clash := sorted(RESERVED_VARIABLES & set(kwargs)):
        raise ChatTemplateError(f"template variables may not be named {', '.join(clash)}: "
                                "the renderer sets those itself")
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update({k: _plain(v) for k, v in kwargs.items()})
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    compiled = _compile(template)
    messages = normalize_messages(messages)
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message: the final message has no text "
                                    "content to continue")
        messages[-1]["content"] += _CONTINUE_MARK
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    if not continue_final_message:
        return text
    end = text.rfind(_CONTINUE_MARK.strip())
    if end < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the "
                                "final message's content as it is, so it cannot be continued")
    whole = text.startswith(_CONTINUE_MARK, end)
    return text[:end] if whole else text[:end].rstrip()
