"""Beam search bookkeeping for one request, with transformers' ``generate(num_beams=...)``
semantics (``GenerationMixin._beam_search``, transformers 5.x), step for step.

The engine runs the model; `BeamSearch` only decides. Each step the engine hands it the
next-token logits of the request's live beams; it answers which beams live on, each as
``(parent, token)``: fork the parent's state (KV cache) and append the token. When
``done`` is set, `results` holds the best finished hypotheses.

The state mirrors transformers' tensors for a batch of one, with the same float32 ops in the
same order, so scores and even ties (``-1e9`` placeholders, ``-inf`` tokens) come out alike:

* ``num_beams`` running beams; at the start only beam 0 is real, the others score ``-1e9``
  so the first expansion does not pick the same token ``num_beams`` times.
* each step keeps the top ``max(2, 1 + num_eos) * num_beams`` candidates over all beams, so
  at least ``num_beams`` of them do not end the hypothesis (end = EOS or max length).
* the best ``num_beams`` candidates that do not end become the next running beams; the
  candidates among the first ``num_beams`` that do end compete, length-penalized, for the
  ``num_beams`` finished slots.

Not covered: sampling beams (``do_sample``), ``forced_eos_token_id`` and the other logits
processors (repetition penalty, no-repeat n-grams), group and constrained beam search.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BeamSearch"]

# transformers' score for "impossible": finite, so adding a log-probability keeps it ordered
# and comparable, unlike -inf.
NEG = -1.0e9


class BeamSearch:
    """One request's beam search.

    :param num_beams: beams kept alive each step (>= 2; transformers decodes greedily at 1).
    :param max_new_tokens: hypotheses end when they reach this many new tokens (EOS and the
        forced first token included). transformers' ``max_length`` is the decoder prompt
        length plus this.
    :param eos_token_ids: tokens that end a hypothesis; may be empty.
    :param length_penalty: a finished hypothesis scores ``sum(logprobs) / len ** lp``: the
        log-probabilities after the bans below (a forced token adds 0), ``len`` its new
        tokens, EOS and forced first token included (for encoder-decoders: the decoder
        sequence without the start token).
    :param early_stopping: ``True`` stops as soon as ``num_beams`` hypotheses finished;
        ``False`` stops when the best running beam, penalized at its current length, cannot
        beat the worst finished one; ``"never"`` penalizes it at ``max_new_tokens`` instead
        when ``length_penalty > 0``.
    :param num_return: how many hypotheses `results` returns (<= ``num_beams``).
    :param min_new_tokens: EOS is banned (``-inf``) while fewer new tokens exist.
        transformers' ``min_length`` L equals ``min_new_tokens = L - decoder prompt length``.
    :param forced_first_token: the first new token, with log-probability 0
        (transformers' ``forced_bos_token_id``: NLLB's target language code).
    """

    def __init__(self, num_beams: int, max_new_tokens: int, eos_token_ids: tuple[int, ...],
                 length_penalty: float = 1.0, early_stopping: bool | str = False,
                 num_return: int = 1, min_new_tokens: int = 0,
                 forced_first_token: int | None = None) -> None:
        if num_beams < 2:
            raise ValueError(f"num_beams must be >= 2, got {num_beams}")
        if not 1 <= num_return <= num_beams:
            raise ValueError(f"num_return must be in [1, num_beams={num_beams}], got {num_return}")
        if max_new_tokens < 1 or min_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 1 and min_new_tokens >= 0")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', "
                             f"got {early_stopping!r}")
        self.num_beams, self.max_new_tokens = num_beams, max_new_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_return, self.min_new_tokens = num_return, min_new_tokens
        self.forced_first_token = forced_first_token
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * num_beams
        self.num_new_tokens = 0  # tokens each running beam holds
        self.done = False
        self._running: list[list[int]] = [[] for _ in range(num_beams)]
        self._running_scores = torch.full((num_beams,), NEG)
        self._running_scores[0] = 0.0
        # NOTE: finished slots stay sorted by score, best first (they come out of a topk).
        self._finished: list[list[int]] = [[] for _ in range(num_beams)]
        self._finished_scores = torch.full((num_beams,), NEG)
        self._is_finished = [False] * num_beams

    def step(self, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Advance by one token.

        :param logits: ``[rows, vocab]`` raw next-token logits (log-probabilities work too:
            log_softmax is applied here and is idempotent). ``rows`` is 1 at the first step
            (the prompt) and ``num_beams`` afterwards, row ``i`` continuing the ``i``-th pair
            the previous step returned.
        :returns: exactly ``num_beams`` ``(parent_row, token)`` pairs, the next live beams
            (best first), or ``[]`` once ``done`` is set (then run no more steps).
        """
        if self.done:
            raise RuntimeError("step() after the search is done")
        is_first = self.num_new_tokens == 0
        rows = 1 if is_first else self.num_beams
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise ValueError(f"expected logits [{rows}, vocab], got {list(logits.shape)}")
        vocab = logits.shape[1]
        logprobs = self._process(torch.log_softmax(logits.float(), dim=-1)).cpu()
        # transformers expands the prompt to num_beams identical rows; the -1e9 of beams
        # 1.. keeps them out of the way unless too few tokens are possible (forced ones).
        total = (logprobs.expand(self.num_beams, vocab)
                 + self._running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(total, self.num_candidates)
        parents, tokens = zip(*(divmod(i, vocab) for i in top_index.tolist()))
        length = self.num_new_tokens + 1
        ends = [t in self.eos_token_ids or length >= self.max_new_tokens for t in tokens]
        candidates = [self._running[p] + [t] for p, t in zip(parents, tokens)]

        # Next running beams: the best candidates that do not end (the small lists here are
        # plain Python; every sum, division and ordering stays a float32 torch op, as in
        # transformers, so ties break alike).
        alive_scores = top_scores + _penalties(ends)
        keep = torch.topk(alive_scores, self.num_beams).indices.tolist()
        self._running = [candidates[i] for i in keep]
        self._running_scores = alive_scores[keep]

        self._update_finished(top_scores, ends, candidates, length)
        self.num_new_tokens = length
        all_full = all(self._is_finished) and self.early_stopping is True
        self.done = all_full or all(ends) or not self._can_improve()
        if self.done:
            return []
        # All beams of the first step come from the single prompt row.
        return [(0 if is_first else parents[i], tokens[i]) for i in keep]

    def results(self) -> list[tuple[list[int], float]]:
        """The best ``num_return`` hypotheses, best first, as transformers returns them:
        ``(new tokens, score)`` with the tokens ending in EOS unless cut by max length, and
        ``score`` = transformers' ``sequences_scores``. A slot no hypothesis ever filled
        (only when fewer than ``num_beams`` tokens are possible at all) scores about -1e9."""
        if not self.done:
            raise RuntimeError("results() before the search is done")
        scores = self._finished_scores[:self.num_return].tolist()
        return [(list(self._finished[i]), scores[i]) for i in range(self.num_return)]

    def _process(self, logprobs: torch.Tensor) -> torch.Tensor:
        """transformers' logits processors, in its order, on log-probabilities (so a banned
        EOS does not renormalize the rest)."""
        if self.num_new_tokens < self.min_new_tokens and self.eos_token_ids:
            logprobs[:, list(self.eos_token_ids)] = -math.inf
        if self.num_new_tokens == 0 and self.forced_first_token is not None:
            logprobs = torch.full_like(logprobs, -math.inf)
            logprobs[:, self.forced_first_token] = 0.0
        return logprobs

    def _update_finished(self, top_scores: torch.Tensor, ends: list[bool],
                         candidates: list[list[int]], length: int) -> None:
        """transformers' ``_update_finished_beams``: only the first ``num_beams`` candidates
        may finish (the rest are spares for the running beams).

        NOTE: transformers also bars new finishes once its heuristic says no improvement is
        possible, or with ``early_stopping=True`` once all slots are full; for one request
        both mean the search is already done, so those terms only matter in a batch."""
        just_finished = [end and i < self.num_beams for i, end in enumerate(ends)]
        scores = top_scores / (length ** self.length_penalty)
        scores = scores + _penalties([not f for f in just_finished])
        merged = torch.cat((self._finished_scores, scores))
        pick = torch.topk(merged, self.num_beams).indices.tolist()
        sequences, finished = self._finished + candidates, self._is_finished + just_finished
        self._finished = [sequences[i] for i in pick]
        self._finished_scores = merged[pick]
        self._is_finished = [finished[i] for i in pick]

    def _can_improve(self) -> bool:
        """transformers' ``_check_early_stop_heuristic``: can the best running beam still
        beat the worst finished slot?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.num_new_tokens
        best_running = float(self._running_scores[0] / (best_length ** self.length_penalty))
        # NOTE: while a slot is empty its -1e9 is the minimum, so any real beam can improve.
        lowest = float(self._finished_scores.min())
        return any(best_running > (lowest if f else NEG) for f in self._is_finished)


def _penalties(flags: list[bool]) -> torch.Tensor:
    """transformers' ``flags * -1e9`` as float32: -1e9 where set, 0 elsewhere."""
    return torch.tensor([NEG if f else 0.0 for f in flags])
