"""Speculative decoding: proposers draft tokens, the target model verifies them in its batch.

Each step, before scheduling, the engine asks the configured `Proposer` for up to ``k``
draft tokens per decoding sequence (``Sequence.draft_token_ids``). The scheduler runs the
sequence's pending token and its drafts as one chunk of ``1 + k`` positions, in the same
flat batch as everything else; the family returns logits for all of them.

Verification (`verify` in the engine) walks the positions in order and, at each, asks the
ordinary sampler for the target's token there (every setting applied: penalties see the
drafts accepted before it, a seeded request draws from its own generator). A draft equal to
that token is accepted and the walk goes on; the first token that differs is emitted in its
place and the walk stops; after the last draft the next position's token is a bonus. For a
proposer that drafts one token deterministically (n-gram lookup, a greedy drafter), this is
the standard rejection rule with a point-mass draft distribution q: a draft x is accepted
with probability min(1, p(x) / q(x)) = p(x), and on rejection the token is drawn from the
normalised (p − q)+, which is p without x. So each emitted token has exactly the target's
distribution, and one uniform draw per emitted token keeps seeded requests' streams
identical with or without speculation.

The KV the rejected drafts wrote stays in blocks past the sequence's computed tokens: the
engine rolls ``num_computed_tokens`` back over it (later writes overwrite it) and frees the
blocks only rejected drafts used (`Scheduler.rollback`). A per-sequence state (a hybrid
model's SSM state) went through the rejected drafts too and cannot step back: the engine
keeps each drafted sequence's state aside before the step (`StatePool.save_before_drafts`)
and, when a draft is rejected, restores it and rolls ``num_computed_tokens`` back to the
pending token, so the next step computes the accepted tokens again with the new one
(replay: a rejection costs a step that emits one token, and no state per draft position).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from heron.core.sequence import Sequence


class Proposer(ABC):
    """Drafts tokens for decoding sequences. Registered by plugins
    (``heron_register_proposers``); built once per engine.

    A proposer that drafts from the target model's hidden states (an MTP head) sets
    `needs_hidden_states`: the engine then asks the runner to keep them
    (``ModelRunner.keep_hidden_states``) and hands each step's rows to `observe`.
    `hidden_layers` says which: ``None`` the final hidden states (after the last norm), an
    int ``n`` the output of layer ``n`` (counted from 1) through the same norm; with more
    than one, `observe` gets them side by side, ``[rows, len(hidden_layers) * hidden]``.
    """

    needs_hidden_states: bool = False
    hidden_layers: tuple[int | None, ...] = (None,)

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens to follow each sequence's ``token_ids`` (``[]``: none
        this step). Must not mutate the sequences."""

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states (`hidden_layers`) ``hidden [n, ...]`` of ``seq``'s
        positions ``start .. start + n - 1``, computed this step (called after the forward
        pass, before verification: positions past the drafts accepted are rolled back, and
        ``seq.num_computed_tokens`` says how many are valid when `propose` next runs). Only
        with `needs_hidden_states`."""

    def fork_sequence(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts as a copy of ``parent`` (a sibling of ``n > 1`` taking the
        prompt its parent computed)."""

    def free_sequence(self, seq: Sequence) -> None:
        """Forget what the proposer keeps for ``seq`` (it finished, aborted or was
        preempted). Must not raise."""

    def draft_source(self, seq: Sequence) -> str | None:
        """Which part of a proposer made of several drafted ``seq``'s last drafts, for the
        metrics; None for a proposer of one part."""
        return None


class LookupFirst(Proposer):
    """Prompt lookup where it finds something, ``model`` (a proposer that drafts with
    weights, such as an MTP head) for the other sequences: on input-grounded text lookup's
    drafts are accepted far more often where they exist, and the head covers the steps
    where they do not. ``model`` observes every step's hidden states, also those of the
    steps lookup drafted, so its state stays whole. `draft_source` names the part
    (``names``: lookup's, the model's)."""

    def __init__(self, lookup: Proposer, model: Proposer,
                 names: tuple[str, str] = ("ngram", "model")) -> None:
        self.lookup, self.model, self.names = lookup, model, names
        self.needs_hidden_states = model.needs_hidden_states
        self.hidden_layers = model.hidden_layers
        self._looked_up: set[int] = set()  # sequences whose last drafts lookup made

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        drafts, rest = self.lookup.propose(seqs, k), []
        for i, (seq, d) in enumerate(zip(seqs, drafts)):
            if d:
                self._looked_up.add(seq.seq_id)
            else:
                self._looked_up.discard(seq.seq_id)
                rest.append(i)
        if rest:
            for i, d in zip(rest, self.model.propose([seqs[i] for i in rest], k)):
                drafts[i] = d
        return drafts

    def draft_source(self, seq: Sequence) -> str:
        return self.names[seq.seq_id not in self._looked_up]

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        self.model.observe(seq, start, hidden)

    def fork_sequence(self, parent: Sequence, child: Sequence) -> None:
        self.lookup.fork_sequence(parent, child)
        self.model.fork_sequence(parent, child)

    def free_sequence(self, seq: Sequence) -> None:
        self._looked_up.discard(seq.seq_id)
        self.lookup.free_sequence(seq)
        self.model.free_sequence(seq)


@dataclass
class SpecStats:
    """Cumulative counts: ``drafts`` verifications run, ``draft_tokens`` proposed,
    ``accepted_tokens`` of them accepted, ``accepted_at[i]`` drafts accepted at position
    ``i`` (0-based) of a draft; ``by_source`` the same for each part of a proposer made of
    several (`Proposer.draft_source`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    by_source: dict[str, SpecStats] = field(default_factory=dict)

    def record(self, num_drafted: int, num_accepted: int, source: str | None = None) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if len(self.accepted_at) < num_drafted:
            self.accepted_at += [0] * (num_drafted - len(self.accepted_at))
        for i in range(num_accepted):
            self.accepted_at[i] += 1
        if source is not None:
            self.by_source.setdefault(source, SpecStats()).record(num_drafted, num_accepted)

    def copy(self) -> SpecStats:
        """A snapshot: `record` goes on changing this one."""
        return SpecStats(self.drafts, self.draft_tokens, self.accepted_tokens,
                         list(self.accepted_at),
                         {name: s.copy() for name, s in self.by_source.items()})

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the one the target
        gives (vLLM's "mean acceptance length")."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0
