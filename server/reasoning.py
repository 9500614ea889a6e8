"""A reasoning model's thinking, apart from its answer (``server.reasoning_parser``).

Models such as DeepSeek-R1 and Qwen3 think between ``<think>`` and ``</think>`` before they
answer. With a parser, a chat answer's thinking comes back as the message's ``reasoning``
(vLLM's field; ``delta.reasoning`` in a stream) and the rest as its ``content``, where tool
calls are looked for; a structured output or a tool call's grammar holds only the answer
(`heron.core.sampling_params.ReasoningGate`), and a request's ``thinking_token_budget``
(Anthropic's ``thinking.budget_tokens``) caps the thinking's tokens (`heron.core.thinking`).

Where an output starts is read off the end of its prompt, which the chat template wrote:

* the prompt ends with ``<think>`` (whitespace aside): the output starts in its thinking, as
  DeepSeek-R1's and Qwen3-Thinking's templates have it;
* it ends with ``</think>``: thinking is off (Qwen3's ``enable_thinking: false``); the
  output is all answer;
* otherwise, with ``"deepseek_r1"`` the output starts in its thinking (R1's first templates
  left ``<think>`` to the model); with ``"qwen3"`` it thinks only if it opens with
  ``<think>``.

An output that thinks and never writes ``</think>`` is all reasoning. The text is split
where ``</think>`` appears in it; the grammar starts after the ``</think>`` token.
"""

from __future__ import annotations

from heron.core.config import ConfigError
from heron.core.sampling_params import ReasoningGate, SamplingParams
from heron.core.tokenizer import Tokenizer
from heron.server.errors import bad_request
from heron.server.markers import marker_prefix

__all__ = ["ReasoningParser", "ReasoningSplit", "plan_thinking", "reasoning_parser"]

START, END = "<think>", "</think>"
_TAIL = 4  # whitespace tokens a prompt may end with after its marker


def reasoning_parser(name: str, tokenizer: Tokenizer | None) -> ReasoningParser | None:
    """The parser ``server.reasoning_parser`` names ("": none); ConfigError when the model
    cannot have it."""
    if not name:
        return None
    if tokenizer is None:
        raise ConfigError(f"server.reasoning_parser {name!r} needs a model with a tokenizer")
    return ReasoningParser(name, tokenizer)


def plan_thinking(parser: ReasoningParser | None, prompt_ids: list[int],
                  params: SamplingParams, budget: int | None = None) -> bool | None:
    """Whether the outputs of ``prompt_ids`` start in their thinking (`ReasoningParser.thinking`;
    None also without a parser). ``params`` gets the thinking's markers (a grammar waits
    for its end) and ``budget``, the request's ``thinking_token_budget``: a 400 without a
    parser, nothing to cap when the prompt turned thinking off."""
    if budget is not None and parser is None:
        raise bad_request("`thinking_token_budget` needs a reasoning model: this server has "
                          "no server.reasoning_parser", param="thinking_token_budget")
    thinking = parser.thinking(prompt_ids) if parser is not None else None
    if thinking is not None:
        params.reasoning = parser.gate(thinking)
        params.thinking_token_budget = budget
    return thinking


class ReasoningParser:
    """The markers of one tokenizer; ConfigError when it lacks them or drops them from text
    (special tokens), since the text is split where they are."""

    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        ids = {marker: tokenizer.token_to_id(marker) for marker in (START, END)}
        lacking = [marker for marker, i in ids.items()
                   if i is None or tokenizer.decode([i]) != marker]
        if lacking:
            raise ConfigError(f"server.reasoning_parser {name!r} needs {START} and {END} as "
                              "tokens that decode to their text; this model's tokenizer "
                              f"{'lacks' if None in ids.values() else 'drops'} "
                              f"{' and '.join(lacking)}")
        self.name = name
        self._tokenizer = tokenizer
        self.start_token_id, self.end_token_id = ids[START], ids[END]

    def thinking(self, prompt_ids: list[int]) -> bool | None:
        """Whether the outputs of this prompt start in their thinking: True; False, they
        may open it with their first token; None, the prompt turned thinking off."""
        for token in reversed(prompt_ids[-_TAIL - 1:]):
            if token == self.start_token_id:
                return True
            if token == self.end_token_id:
                return None
            if self._tokenizer.decode([token], skip_special_tokens=False).strip():
                break
        return self.name == "deepseek_r1"  # its first templates left <think> to the model

    def thinking_tokens(self, token_ids: list[int], opened: bool | None) -> int:
        """How many of an output's tokens are its thinking, markers included (``opened``:
        as `thinking` said of its prompt)."""
        if opened is None or not token_ids or not (opened or token_ids[0] == self.start_token_id):
            return 0
        if self.end_token_id in token_ids:
            return token_ids.index(self.end_token_id) + 1
        return len(token_ids)

    def gate(self, opened: bool) -> ReasoningGate:
        """What a grammar leaves free of an output that starts as ``thinking`` said."""
        return ReasoningGate(start_token_id=self.start_token_id,
                             end_token_id=self.end_token_id, open=opened)


class ReasoningSplit:
    """One output's text, split as it streams: `feed` takes each new piece and returns
    what of it (and of what it held back) is reasoning and what is content. Text that may
    be the start of a marker is held until the next piece shows whether it is.

    ``opened``: the output starts in its thinking (`ReasoningParser.thinking`). A leading
    ``<think>`` (whitespace aside) opens it, or repeats the prompt's; it is not reasoning.
    None: there is no thinking to split off (no parser, or the prompt turned it off): the
    text is all content.
    """

    def __init__(self, opened: bool | None) -> None:
        self._thinking = bool(opened)
        self._head = opened is not None  # nothing but whitespace yet: a <think> may come
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of ``text``; ``final``: the output ended, hold nothing."""
        text, self._held = self._held + text, ""
        if self._head:
            stripped = text.lstrip()
            if stripped.startswith(START):
                text, self._thinking, self._head = stripped[len(START):], True, False
            elif START.startswith(stripped) and not final:
                self._held = text
                return "", ""
            else:
                self._head = False
        if not self._thinking:
            return "", text
        end = text.find(END)
        if end >= 0:
            self._thinking = False
            return text[:end], text[end + len(END):]
        keep = 0 if final else marker_prefix(text, END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""
