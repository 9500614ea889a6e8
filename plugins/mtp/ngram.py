"""Prompt lookup: draft what followed the last occurrence of the sequence's final n-gram.

Text that quotes or edits its input (summaries, code edits, extraction) repeats spans of
the prompt; when the last ``n`` tokens appeared before, the tokens after that earlier
occurrence are a free guess at what comes next. No weights; each sequence keeps an index
of its n-grams, so that a step's lookup costs the same at 100 tokens as at 100k.
"""

from __future__ import annotations

from heron.core import Sequence
from heron.core.speculative import Proposer


class NgramIndex:
    """The latest start of every n-gram (``min_n <= n <= max_n``) of a growing token list
    that has a token after it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: it predicts best
        self.latest: dict[tuple[int, ...], int] = {}
        self.num_indexed = {n: 0 for n in self.sizes}  # starts 0 .. num_indexed[n] - 1

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``tokens`` ([] without one). ``tokens`` must extend the list of the
        previous call."""
        for n in self.sizes:
            for start in range(self.num_indexed[n], len(tokens) - n):
                self.latest[tuple(tokens[start:start + n])] = start
            self.num_indexed[n] = max(self.num_indexed[n], len(tokens) - n)
        for n in self.sizes:
            start = self.latest.get(tuple(tokens[-n:])) if n < len(tokens) else None
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        return [self.indexes.setdefault(seq.seq_id, NgramIndex(self.min_n, self.max_n))
                .lookup(seq.token_ids, k) for seq in seqs]

    def free_sequence(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
