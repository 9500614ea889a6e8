"""Tool calling for /v1/chat/completions, with vLLM's conventions.

``tool_choice`` decides how calls come out of the model:

* a named function, or ``"required"``: the output is held to a JSON grammar (structured
  outputs), the function's ``parameters`` schema, or an array of ``{"name", "parameters"}``
  objects, one of the tools each; so the calls always parse.
* ``"auto"`` (the default when tools are given): the model decides, and a parser reads its
  calls out of the text (``server.tool_call_parser``: `heron.server.tool_parsers`). Without
  a parser, "auto" is refused, as vLLM does.
* ``"none"``: plain text; the tools are not shown to the chat template.

Arguments come back as JSON strings, OpenAI's shape.
"""

from __future__ import annotations

import json
import uuid

from heron.core.sampling_params import StructuredOutput
from heron.server.errors import bad_request
from heron.server.responses import ToolCall, ToolCallFunction
from heron.server.tool_parsers import FORMATS, CallFormat, read_calls

__all__ = ["CallHold", "ToolPlan", "new_call_id", "plan_tools", "template_tools"]


class ToolPlan:
    """How one request's tools shape its prompt (`template_tools`), its grammar
    (`structured`) and its answer (`parse`).

    ``mode``: "none", "auto", "required" or "named" (then ``function`` is the name);
    ``form``: how "auto" answers write their calls."""

    def __init__(self, mode: str, tools: list[dict], function: str = "",
                 parallel: bool = True, form: CallFormat | None = None) -> None:
        self.mode = mode
        self.tools = tools
        self.function = function
        self.parallel = parallel  # False: "required" makes exactly one call
        self.form = form

    @property
    def keeps_markers(self) -> bool:
        """Whether the text must keep special tokens: the "auto" calls' markers are some."""
        return self.mode == "auto" and self.form.special_markers

    @property
    def template_tools(self) -> list[dict] | None:
        """The ``tools`` variable of the chat template."""
        return self.tools if self.mode != "none" else None

    @property
    def structured(self) -> StructuredOutput | None:
        if self.mode == "named":
            return StructuredOutput(json=self._parameters(self.function), param="tools")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "parameters": self._parameters(t["function"]["name"])}}
                 for t in self.tools]
        return StructuredOutput(json={"type": "array", "minItems": 1,
                                      **({} if self.parallel else {"maxItems": 1}),
                                      "items": {"anyOf": calls}}, param="tools")

    def _parameters(self, name: str) -> dict:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object"}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls in ``text``, the model's output. A named
        call is the text, whole or cut short; other calls that do not parse (a length cut,
        a model's slip) leave ``text`` as the content."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":  # streamed as it comes, cut short or not: OpenAI's way
            return None, [_call(self.function, text)]
        if self.mode == "required":
            try:
                return None, [_call(c["name"], _dumps(c["parameters"])) for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return text, []
        found = read_calls(self.form, text)
        if found is None:
            return text, []
        content, calls = found
        return content, [_call(name, arguments) for name, arguments in calls]


class CallHold:
    """An "auto" answer in a stream: its content goes out as it comes until the model
    starts a call (`CallFormat.start`); the rest is held, for `end` to parse whole.
    Whitespace and what may yet start a call wait for the next piece, since `ToolPlan.parse`
    drops the whitespace before a call: the content sent is the content `parse` finds."""

    def __init__(self, form: CallFormat) -> None:
        self.form = form
        self.text = ""
        self._sent = 0  # text[:_sent] went out as content
        self._calling = False

    def feed(self, piece: str) -> str:
        """The content to send now, of ``piece`` and what was held."""
        self.text += piece
        if self._calling:
            return ""
        at = self.form.start(self.text, self._sent)
        if at is not None:
            self._calling = True
            end = len(self.text[:at].rstrip())
        else:
            end = len(self.text[:len(self.text) - self.form.undecided(self.text)].rstrip())
        out = self.text[self._sent:max(end, self._sent)]
        self._sent += len(out)
        return out

    def end(self, plan: ToolPlan) -> tuple[str, list[ToolCall]]:
        """Once the output ended: the content left to send, and the calls."""
        _, calls = plan.parse(self.text)
        if calls:
            return "", calls
        rest, self._sent = self.text[self._sent:], len(self.text)
        return rest, []


def _dumps(arguments) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=arguments))


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def template_tools(functions: list) -> list[dict]:
    """The chat template's ``tools`` of a request's ``functions``; a 400 if a name repeats."""
    tools = [{"type": "function", "function": {k: v for k, v in (
        ("name", f.name), ("description", f.description),
        ("parameters", f.parameters)) if v is not None}} for f in functions]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("`tools` names a function twice", param="tools")
    return tools


def plan_tools(functions: list | None, choice: str | None, named: str | None,
               parallel: bool | None, parser: str, constrained_by: str | None) -> ToolPlan | None:
    """The `ToolPlan` of a request's ``functions`` (each with ``name``, ``description`` and
    ``parameters``), or None without any; 400s name what is wrong.

    ``choice``: "none", "auto", "required" or None (unset); ``named``: the function a
    request names instead; ``parallel``: False for one call at most; ``constrained_by``:
    the field that already holds the output to a grammar, if one does."""
    if not functions:
        if named is not None or choice not in (None, "none", "auto"):
            raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
        return None
    tools = template_tools(functions)
    names = [t["function"]["name"] for t in tools]
    mode = "named" if named is not None else choice or "auto"
    if named is not None and named not in names:
        raise bad_request(f"`tool_choice` names the function `{named}`, which is not "
                          "among `tools`", param="tool_choice")
    if mode == "auto" and not parser:  # the config admits only known parsers
        raise bad_request('`tool_choice` "auto" needs a tool-call parser: this server has '
                          'none (server.tool_call_parser); use "required", a named function '
                          'or "none"', param="tool_choice")
    if mode != "none" and constrained_by is not None:
        raise bad_request(f"tool calls and `{constrained_by}` exclude each other (unless "
                          '`tool_choice` is "none")', param="tool_choice")
    return ToolPlan(mode, tools, named or "", parallel is not False, FORMATS.get(parser))
