"""Structured outputs: each request's grammar, as a token mask on its logits.

A request's `StructuredOutput` (a JSON schema, a regex, a list of choices or a Lark grammar)
compiles to an ``llguidance.LLMatcher`` per sequence (`Grammars.compile`). Before each
sample, the rows of sequences with a matcher get ``-inf`` on every token the grammar does not
allow next (`apply_grammar_masks`); when a token lands, the sequence's output consumes it
(`heron.core.request`) and ends once the grammar is complete.

Masks are computed on the host from the matcher's state, so a row's mask needs the
sequence's previous token: the engine resolves a step's tokens before it samples the next
(`heron.core.inflight`), and draft verification samples position by position.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from functools import cached_property
from typing import TYPE_CHECKING

import msgspec
import tokenizers
import torch

from heron.core.device import to_device
from heron.core.sampling_params import StructuredOutput
from heron.core.sequence import Sequence

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

__all__ = ["Grammars", "apply_grammar_masks"]

# JSON without free whitespace between tokens: compact output, and a model cannot spend its
# max_tokens on blanks (vLLM allows them unless told otherwise)
_JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """Compiles `StructuredOutput` specs for one tokenizer and logits width.

    Thread-safe: the async engine compiles off the step loop. Compiled grammars are kept
    (the last ``cache_size`` specs), so a request that repeats one (the same schema, the
    same tools) only copies its start state.

    :param tokenizer: the model's ``tokenizers.Tokenizer``.
    :param vocab_size: the logits' width (may exceed the tokenizer's vocabulary).
    :param eos_token_ids: the ids a complete grammar allows next.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                 eos_token_ids: tuple[int, ...], cache_size: int = 64) -> None:
        self._backend = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[bytes, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: LLTokenizer | None = None

    @cached_property
    def _llguidance(self):
        # imported on first use: the engine runs without it where it is missing (a bare GPU
        # image), as long as no request asks for structured outputs
        import llguidance
        return llguidance

    def _tokenizer(self) -> LLTokenizer:
        # built on first use: ~0.2 s for a 50k vocabulary, paid by guided requests only
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._llguidance.LLTokenizer(
                    self._backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> LLMatcher:
        """A matcher in the grammar's start state; `StructuredOutputError` naming what is
        wrong with ``spec``."""
        key = msgspec.json.encode(msgspec.structs.replace(spec, param=None),
                                  order="sorted")
        with self._lock:
            start = self._compiled.get(key)
            if start is not None:
                self._compiled.move_to_end(key)
                return start.deep_copy()
        matcher_cls = self._llguidance.LLMatcher
        start = matcher_cls(self._tokenizer(), _grammar(matcher_cls, spec), log_level=0)
        if start.is_error():
            raise StructuredOutputError(f"the structured output's {_KINDS[spec.kind]} is not "
                                        f"valid: {start.get_error()}", spec.param)
        with self._lock:
            self._compiled[key] = start
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return start.deep_copy()


class StructuredOutputError(ValueError):
    """A structured output that does not compile; ``param`` names the request field that
    gave it (`StructuredOutput.param`), or is None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_KINDS = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
          "grammar": "Lark grammar"}


def _grammar(matcher_cls: type[LLMatcher], spec: StructuredOutput) -> str:
    if spec.json is not None:
        return matcher_cls.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return matcher_cls.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # JSON string literals are Lark string literals
        return matcher_cls.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    return matcher_cls.grammar_from_lark(spec.grammar)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to ``-inf`` (in place) every logit that a row's grammar does not allow next;
    rows of sequences without one, or in their thinking, are left alone."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and not seq.thinking]
    if not rows:
        return
    vocab_size = logits.shape[1]
    # one bit per token, 32 to an int32 word, lowest bit first; the executor fills the rows
    # on its own threads, without the GIL
    words = torch.empty(len(rows), (vocab_size + 31) // 32, dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr([(seqs[i].grammar, k) for k, i in enumerate(rows)],
                                        words.data_ptr(), words.shape[1] * 4, len(rows))
    words = to_device(words, torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab_size]
    banned = allowed == 0
    for k, i in enumerate(rows):  # a reasoning model's first token may open its thinking
        gate = seqs[i].params.reasoning
        if gate is not None and seqs[i].num_output_tokens == 0:
            banned[k, gate.start_token_id] = False
    if len(rows) == len(seqs):
        logits.masked_fill_(banned, float("-inf"))
        return
    index = to_device(rows, torch.long, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


@functools.cache
def _executor():
    import llguidance  # only once a request asks for structured outputs: see `Grammars`
    return llguidance.LLExecutor()
