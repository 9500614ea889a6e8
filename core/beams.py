"""A beam-search request in the engine: its `BeamSearch` and the sequences of its beams.

Each beam is a `Sequence` the scheduler runs like any other; beams that share a history
share one sequence until they differ (at the start every beam is the prompt's). A step
reaches the search only when every live sequence of the request has computed its last
token; one that ran ahead while a sibling was preempted or left out of the step computes
that token again with the others next time (`Engine` rewinds it by one token).

The outputs exist from the start, empty, so an abort or a fault can finish them; the
search's best hypotheses fill them when it is done.
"""

from __future__ import annotations

from heron.core.beam_search import BeamSearch
from heron.core.outputs import CompletionOutput
from heron.core.sequence import Sequence


class BeamGroup:
    def __init__(self, search: BeamSearch, root: Sequence, num_forced: int,
                 num_return: int) -> None:
        self.search = search
        self.beams: list[Sequence] = [root]  # one entry per running beam; entries may repeat
        self.num_forced = num_forced  # prompt tokens the search counts as generated
        self.outputs = [CompletionOutput(i) for i in range(num_return)]
        self.rows: dict[int, int] = {}  # seq id -> its logits row in this step

    @property
    def live(self) -> list[Sequence]:
        """The distinct sequences of the running beams."""
        return list({id(s): s for s in self.beams}.values())

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def ready(self) -> bool:
        return all(s.seq_id in self.rows for s in self.live)

    def beam_rows(self) -> list[int]:
        return [self.rows[s.seq_id] for s in self.beams]

    def fill_outputs(self, tokenizer, eos_token_ids: tuple[int, ...],
                     skip_special_tokens: bool) -> None:
        """The search is done: its best hypotheses, without the forced prompt tokens."""
        for out, (tokens, score) in zip(self.outputs, self.search.results()):
            tokens = tokens[self.num_forced:]
            out.token_ids = out.new_token_ids = tokens
            out.text = out.new_text = (tokenizer.decode(tokens, skip_special_tokens)
                                       if tokenizer is not None else "")
            out.score = score
            out.finish_reason = "stop" if tokens and tokens[-1] in eos_token_ids else "length"

    def finish(self, reason: str, error: str | None = None) -> None:
        for out in self.outputs:
            if out.finish_reason is None:
                out.finish_reason, out.error = reason, error
