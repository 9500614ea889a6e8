"""Reading the tool calls an "auto" answer wrote into its text (``server.tool_call_parser``).

A format says where calls start in a text as it streams (`CallFormat.start`), how much of
its tail may yet turn out to start one (`undecided`), and what the whole text holds
(`read_calls`): its content and calls, or None when no call in it parses (a length cut, a
model's slip), and then it is all content.

* ``hermes``: JSON objects ``{"name", "arguments"}`` between ``<tool_call>`` and
  ``</tool_call>``, after any content (Qwen, Hermes).
* ``llama3_json``: the whole answer is JSON objects ``{"name", "parameters"}`` (or
  ``"arguments"``) separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 to
  3.3; the tag is a special token, gone from the text unless ``skip_special_tokens`` is
  false).
* ``pythonic``: the whole answer is a Python list of calls with literal keyword
  arguments, ``[get_weather(city="Paris"), get_time(zone=1)]`` (Llama 3.2 and 4, Olmo).
* ``mistral``: after any content, ``[TOOL_CALLS]`` and a JSON array of ``{"name",
  "arguments"}`` objects (Mistral's v3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` per
  call (v11 and later; a ``[CALL_ID]id`` may come before ``[ARGS]``). The markers are
  special tokens: requests the parser reads keep special tokens in their text.

A call's arguments must be an object (a dict); they come back as a JSON string.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from heron.server.markers import marker_prefix

__all__ = ["FORMATS", "CallFormat", "read_calls"]

Calls = list[tuple[str, Any]]  # (name, arguments)


class CallFormat:
    """Calls anywhere after the content, each opening with ``marker`` (the base) or, in a
    subclass, the whole answer."""

    marker = ""
    special_markers = False  # the markers are special tokens (the text must keep them)

    def start(self, text: str, begin: int = 0) -> int | None:
        """Where the calls in ``text`` start, if they have (searching from ``begin``)."""
        at = text.find(self.marker, begin)
        return at if at >= 0 else None

    def undecided(self, text: str) -> int:
        """How many characters at the end of ``text`` may yet start a call."""
        return marker_prefix(text, self.marker)

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        """A whole answer's content and calls; None, or any error `read_calls` catches,
        when it holds none that parse."""
        raise NotImplementedError


class Hermes(CallFormat):
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        objects = [json.loads(m[1]) for m in self._CALL.finditer(text)]
        if not objects:
            return None
        content = text[:text.index(self.marker)].rstrip() or None
        return content, [(o["name"], o.get("arguments", {})) for o in objects]


class _WholeAnswer(CallFormat):
    """Calls that are the whole answer: it starts with one of ``openers`` (after
    whitespace) or holds none."""

    openers: tuple[str, ...] = ()

    def start(self, text: str, begin: int = 0) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(self.openers) else None

    def undecided(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if any(o.startswith(body) for o in self.openers) else 0


class Llama3Json(_WholeAnswer):
    openers = ("{", "<|python_tag|>")
    _SEPARATOR = re.compile(r"\s*;\s*")

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            obj, at = decoder.raw_decode(body, at)
            calls.append((obj["name"], obj["parameters"] if "parameters" in obj
                          else obj["arguments"]))
            if at == len(body):
                return None, calls
            separator = self._SEPARATOR.match(body, at)
            if separator is None or separator.end() == at:
                return None
            at = separator.end()


class Pythonic(_WholeAnswer):
    openers = ("[", "<|python_start|>")

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        tree = ast.parse(body.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args or any(k.arg is None for k in node.keywords)):
                return None
            calls.append((node.func.id, {k.arg: ast.literal_eval(k.value)
                                         for k in node.keywords}))
        return None, calls


class Mistral(CallFormat):
    marker = "[TOOL_CALLS]"
    special_markers = True

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        at = text.index(self.marker)
        calls: Calls = []
        for part in text[at:].split(self.marker)[1:]:
            if "[ARGS]" in part:
                name, _, arguments = part.partition("[ARGS]")
                calls.append((name.split("[CALL_ID]")[0].strip(), json.loads(arguments)))
            else:
                listed = json.loads(part)
                calls += [(c["name"], c.get("arguments", {}))
                          for c in (listed if isinstance(listed, list) else [listed])]
        return text[:at].rstrip() or None, calls


FORMATS: dict[str, CallFormat] = {"hermes": Hermes(), "llama3_json": Llama3Json(),
                                  "pythonic": Pythonic(), "mistral": Mistral()}


def read_calls(form: CallFormat, text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``text``'s content and calls, each ``(name, arguments as JSON)``; None when it
    holds no call that parses."""
    try:
        found = form.parse(text)
        if found is None:
            return None
        content, calls = found
        if not calls or not all(isinstance(name, str) and name and isinstance(args, dict)
                                for name, args in calls):
            return None
        # NaN and Infinity (Python's literals, or JSON's extension) are not JSON
        return content, [(name, json.dumps(args, ensure_ascii=False, allow_nan=False))
                         for name, args in calls]
    except (ValueError, KeyError, TypeError, AttributeError, SyntaxError, RecursionError,
            MemoryError):
        return None
