"""Per-request generation settings, shared by the engine, sampler and server."""

from __future__ import annotations

import math

import msgspec


class ReasoningGate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where a reasoning model's thinking is in an output: it ends with the output's first
    ``end_token_id``. ``open``: the output starts inside the thinking (its prompt opened
    it); otherwise the output may open it with ``start_token_id`` as its first token, and
    has no thinking if it does not. A grammar holds from the token after the thinking;
    ``SamplingParams.thinking_token_budget`` counts the tokens inside it."""

    start_token_id: int
    end_token_id: int
    open: bool = False


class StructuredOutput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the output must match (vLLM's ``structured_outputs``), exactly one of: ``json``,
    a JSON schema (``{"type": "object"}``: any JSON object); ``regex``; ``choice``, one of
    these strings; ``grammar``, a Lark grammar. The output ends once it is complete.
    A reasoning model's thinking (``SamplingParams.reasoning``) comes first, free of the
    grammar. ``param``: where the request gave it (``response_format``...), for
    `StructuredOutputError`."""

    json: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # the request field it came from, which an error compiling it names
    param: str | None = None

    @property
    def kind(self) -> str:
        """The one field set (`validate` checks there is one)."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) is not None)

    def validate(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice "
                             f"and grammar; got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs: choice must list at least one string")


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a request asks of generation.

    Defaults follow the OpenAI / vLLM conventions. ``temperature == 0`` means greedy.
    ``top_k <= 0`` disables top-k; ``top_p == 1`` and ``min_p == 0`` disable those filters.
    ``logprobs`` is the number of top alternatives returned per generated token (None: no
    logprobs at all; 0: only the chosen token's); ``prompt_logprobs`` likewise per prompt token.
    Logprobs are those of the model's raw distribution (before temperature and filters).
    ``logit_bias`` maps token ids to a bias in ``[-100, 100]`` added to their logits before
    the penalties and sampling (OpenAI's field; -100 all but bans a token, 100 all but
    forces it); the logprobs stay those of the raw distribution, as vLLM's.
    ``allowed_token_ids`` (vLLM's) leaves only those tokens to sample; ``bad_words_token_ids``
    (vLLM's ``bad_words``, tokenized) bans each word's last token wherever the output so far
    ends with the word's other tokens (a one-token word always).
    ``structured_outputs`` constrains the output to a grammar (`StructuredOutput`,
    `heron.core.grammar`); logprobs stay those of the unconstrained distribution.
    ``reasoning`` marks a reasoning model's thinking (`ReasoningGate`), which a grammar
    leaves free; ``thinking_token_budget`` (vLLM's; it needs ``reasoning``) caps the tokens
    inside the thinking: once it holds that many, its end token is the only one left to
    sample (0: the thinking ends at once).

    ``num_beams > 1`` asks for beam search with transformers' ``generate`` semantics
    (`heron.core.beam_search`): ``length_penalty``, ``early_stopping`` (True, False or
    "never"), ``min_tokens``, ``max_tokens``; the ``n`` best hypotheses (``n <= num_beams``)
    are the request's outputs. It is deterministic, as transformers' is without sampling:
    temperature and the top-k/top-p/min-p filters do not apply, and penalties, logit
    bias, structured outputs, stop strings and logprobs are refused.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []
    structured_outputs: StructuredOutput | None = None
    reasoning: ReasoningGate | None = None
    thinking_token_budget: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    speculative: bool = True  # False: never draft for this request (`heron.core.speculative`)
    priority: int = 0  # lower runs first (`heron.core.scheduler`); scheduling_policy "priority"

    def validate(self, vocab_size: int | None = None, priorities: bool = True) -> None:
        """Raise ValueError naming the first field out of range (``logit_bias`` ids must lie
        below ``vocab_size`` when it is given; ``priority`` must be 0 unless ``priorities``,
        the engine's ``scheduling_policy = "priority"``)."""
        checks = (
            ("n", self.n >= 1),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1),
            ("min_tokens", self.min_tokens >= 0),
            ("temperature", self.temperature >= 0.0),
            ("top_k", self.top_k >= -1),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            ("repetition_penalty", self.repetition_penalty > 0.0),
            ("logprobs", self.logprobs is None or self.logprobs >= 0),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0),
            ("thinking_token_budget",
             self.thinking_token_budget is None or self.thinking_token_budget >= 0),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name} is out of range: {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens is out of range: {self.min_tokens} is more than "
                             f"max_tokens ({self.max_tokens})")
        limit = math.inf if vocab_size is None else vocab_size
        bad = next(((t, b) for t, b in self.logit_bias.items()
                    if not 0 <= t < limit or not -100.0 <= b <= 100.0), None)
        if bad is not None:
            ids = ">= 0" if vocab_size is None else f"0..{vocab_size - 1}"
            raise ValueError(f"logit_bias is out of range: {bad[1]!r} for token {bad[0]} "
                             f"(token ids {ids}, biases in [-100, 100])")
        if any(not 0 <= t < limit for t in self.stop_token_ids):
            raise ValueError("stop_token_ids is out of range: token ids "
                             f"{'>= 0' if vocab_size is None else f'0..{vocab_size - 1}'}")
        allowed = [] if self.allowed_token_ids is None else [self.allowed_token_ids]
        for name, lists in (("allowed_token_ids", allowed),
                            ("bad_words_token_ids", self.bad_words_token_ids)):
            if any(not ids or not all(0 <= t < limit for t in ids) for ids in lists):
                raise ValueError(f"{name} is out of range: each list needs token ids "
                                 f"{'>= 0' if vocab_size is None else f'0..{vocab_size - 1}'}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        gate = self.reasoning
        if gate is not None and not (0 <= gate.start_token_id < limit
                                     and 0 <= gate.end_token_id < limit):
            raise ValueError(f"reasoning: the thinking's tokens {gate.start_token_id} and "
                             f"{gate.end_token_id} must be in the vocabulary")
        if self.thinking_token_budget is not None and gate is None:
            raise ValueError("thinking_token_budget needs `reasoning`: the tokens that start "
                             "and end the thinking it counts")
        if self.priority and not priorities:
            raise ValueError('priority needs engine.scheduling_policy = "priority" (this '
                             "engine runs requests first come, first served)")
        if self.num_beams < 1:
            raise ValueError(f"num_beams is out of range: {self.num_beams!r}")
        if not -10.0 <= self.length_penalty <= 10.0:  # length ** it must stay a float
            raise ValueError(f"length_penalty is out of range: {self.length_penalty!r} "
                             "(from -10 to 10)")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping is out of range: {self.early_stopping!r} "
                             "(true, false or \"never\")")
        if self.num_beams > 1:
            self._validate_beams()

    def _validate_beams(self) -> None:
        if self.n > self.num_beams:
            raise ValueError(f"n is out of range: {self.n} > num_beams ({self.num_beams})")
        unsupported = [name for name, value, plain in (
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0), ("stop", self.stop, []),
            ("stop_token_ids", self.stop_token_ids, []), ("logit_bias", self.logit_bias, {}),
            ("allowed_token_ids", self.allowed_token_ids, None),
            ("bad_words_token_ids", self.bad_words_token_ids, []),
            ("structured_outputs", self.structured_outputs, None),
            ("thinking_token_budget", self.thinking_token_budget, None),
            ("logprobs", self.logprobs, None),
            ("prompt_logprobs", self.prompt_logprobs, None)) if value != plain]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported with beam search "
                             f"(num_beams {self.num_beams}): leave it at its default")
