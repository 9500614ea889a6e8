"""Prompt lookup: draft what followed the last occurrence of the sequence's final n-gram.

Text that quotes or edits its input (summaries, code edits, extraction) repeats spans of
the prompt; when the last ``n`` tokens appeared before, the tokens after that earlier
occurrence are a free guess at what comes next. No weights, no state.
"""

from __future__ import annotations

from heron.core import Sequence
from heron.core.speculative import Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq in seqs]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram (``max_n`` down to ``min_n`` tokens) of ``tokens``; [] without one."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            first = suffix[0]
            # latest start first: recent context predicts best
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []
