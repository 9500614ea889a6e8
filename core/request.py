"""Per-request output bookkeeping: detokenizing, stop checks, logprobs, finish reasons.

Kept beside the `Sequence` (not in it) so the scheduler's record stays small.
"""

from __future__ import annotations

from heron.core.detokenizer import IncrementalDetokenizer
from heron.core.logprobs import TokenLogprobs
from heron.core.outputs import CompletionOutput, RequestOutput
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence
from heron.core.stop import StopChecker
from heron.core.thinking import follow_thinking


class SeqOutput:
    """Turns one sequence's new tokens into text deltas and decides when it stops."""

    def __init__(self, seq: Sequence, index: int, tokenizer, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        params = seq.params
        self.seq = seq
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.max_model_len = max_model_len
        self.detok = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                             params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stop = (StopChecker(params.stop, params.include_stop_str_in_output)
                     if params.stop else None)
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)

    def begin_step(self) -> None:
        self.out.new_text = ""
        self.out.new_token_ids = []

    def append(self, token_id: int, logprob: TokenLogprobs | None) -> None:
        """Record a token the engine appended to the sequence; may finish the output."""
        seq, params, out = self.seq, self.seq.params, self.out
        out.token_ids.append(token_id)
        out.new_token_ids.append(token_id)
        if logprob is not None and out.logprobs is not None:
            logprob.text_offset = len(self.detok.output_text) if self.detok is not None else 0
            out.logprobs.append(logprob)
        stop_token = token_id in params.stop_token_ids
        if stop_token or token_id in self.eos_token_ids:
            if params.include_stop_str_in_output:  # its text too (none if a skipped special)
                matched = self._add_text(token_id)
                if matched is not None:
                    return self.finish("stop", matched, flush=False)
            return self.finish("stop", token_id if stop_token else None)
        matched = self._add_text(token_id)
        if matched is not None:
            return self.finish("stop", matched, flush=False)
        if not follow_thinking(seq, token_id) and seq.grammar is not None:
            if not seq.grammar.consume_token(token_id):  # the mask allowed it: a bug if so
                return self.finish("error", error="the output left its structured-output "
                                   f"grammar: {seq.grammar.get_error()}")
            if seq.grammar.is_stopped():  # complete: nothing but EOS may follow
                return self.finish("stop")
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self.finish("length")
        if len(seq) >= self.max_model_len:
            return self.finish("length")

    def _add_text(self, token_id: int) -> str | None:
        """Emit the text ``token_id`` completes; returns the stop string it completed."""
        delta = self.detok.append([token_id]) if self.detok is not None else ""
        if self.stop is not None and self.seq.num_output_tokens > self.seq.params.min_tokens - 1:
            delta, matched = self.stop.feed(delta)
            self._emit(delta)
            return matched
        self._emit(delta)
        return None

    def _emit(self, text: str) -> None:
        self.out.text += text
        self.out.new_text += text

    def finish(self, reason: str, stop_reason: int | str | None = None, *,
               flush: bool = True, error: str | None = None) -> None:
        if self.out.finish_reason is not None:
            return
        if flush:
            # text held back for an unfinished character or a possible stop string
            tail = self.detok.flush() if self.detok is not None else ""
            if self.stop is not None:
                text, matched = self.stop.feed(tail)
                self._emit(text)
                if matched is None:
                    self._emit(self.stop.flush())
                    matched = self.stop.matched
                if matched is not None:
                    reason, stop_reason = "stop", matched
            else:
                self._emit(tail)
        self.out.finish_reason = reason
        self.out.stop_reason = stop_reason
        self.out.error = error


class RequestState:
    """A request's sequences and outputs as the engine tracks them."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], outputs: list[SeqOutput]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.outputs = outputs
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.unforked: list[Sequence] = []  # siblings waiting for the first one's prompt
        self.beam = None  # a BeamGroup for beam search (then ``outputs`` is empty)
        self.embedding = None  # an embedding model's vector (`heron.core.pooling`)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.finished
        return all(o.out.finish_reason is not None for o in self.outputs)

    def finish(self, reason: str, error: str | None = None) -> None:
        """End every output now (an abort or a fault)."""
        if self.beam is not None:
            self.beam.finish(reason, error)
        for out in self.outputs:
            out.finish(reason, error=error)

    def snapshot(self) -> RequestOutput:
        outs = self.beam.outputs if self.beam is not None else [o.out for o in self.outputs]
        return RequestOutput(self.request_id, self.prompt_token_ids, outs, self.prompt_logprobs,
                             self.seqs[0].num_cached_tokens or 0, self.embedding)
