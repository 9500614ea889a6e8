"""Beam search bookkeeping for one request, with transformers' ``generate(num_beams=...)``
semantics (``GenerationMixin._beam_search``, transformers 5.x), step for step.

The engine runs the model; `BeamSearch` only decides. Each step the engine hands it the
next-token logits of the request's live beams; it answers which beams live on, each as
``(parent, token)``: fork the parent's state (KV cache) and append the token. When
``done`` is set, `results` holds the best finished hypotheses.
`step_searches` steps many requests' searches as one batch of tensor ops.

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

__all__ = ["BeamSearch", "step_searches"]

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
        if logits.dim() != 2:
            raise ValueError(f"expected logits [rows, vocab], got {list(logits.shape)}")
        return step_searches([self], logits, [list(range(logits.shape[0]))])[0]

    @property
    def num_rows(self) -> int:
        """The logits rows the next step takes: 1 at the first step, then ``num_beams``."""
        return 1 if self.num_new_tokens == 0 else self.num_beams

    def results(self) -> list[tuple[list[int], float]]:
        """The best ``num_return`` hypotheses, best first, as transformers returns them:
        ``(new tokens, score)`` with the tokens ending in EOS unless cut by max length, and
        ``score`` = transformers' ``sequences_scores``. A slot no hypothesis ever filled
        (only when fewer than ``num_beams`` tokens are possible at all) scores about -1e9."""
        if not self.done:
            raise RuntimeError("results() before the search is done")
        scores = self._finished_scores[:self.num_return].tolist()
        return [(list(self._finished[i]), scores[i]) for i in range(self.num_return)]

    def _process(self, logprobs: torch.Tensor) -> None:
        """transformers' logits processors, in its order, in place on this search's rows of
        log-probabilities (so a banned EOS does not renormalize the rest)."""
        if self.num_new_tokens < self.min_new_tokens and self.eos_token_ids:
            logprobs[:, list(self.eos_token_ids)] = -math.inf
        if self.num_new_tokens == 0 and self.forced_first_token is not None:
            logprobs.fill_(-math.inf)
            logprobs[:, self.forced_first_token] = 0.0


def step_searches(searches: list[BeamSearch], logits: torch.Tensor,
                  rows: list[list[int]]) -> list[list[tuple[int, int]]]:
    """`BeamSearch.step` for several searches at once: search ``i`` steps on
    ``logits[rows[i]]`` and gets the ``i``-th list of pairs. The same float32 ops as one
    search alone, batched: each search's are a row of them (a step of 64 requests was 1,300
    tiny tensor ops one search at a time)."""
    for search, r in zip(searches, rows):
        if search.done:
            raise RuntimeError("step() after the search is done")
        if len(r) != search.num_rows:
            raise ValueError(f"expected logits [{search.num_rows}, vocab], "
                             f"got {[len(r), logits.shape[-1]]}")
    flat = [i for r in rows for i in r]
    logprobs = torch.log_softmax(logits[flat].float(), dim=-1).cpu()
    starts, at = [], 0
    for search, r in zip(searches, rows):
        search._process(logprobs[at:at + len(r)])
        starts.append(at)
        at += len(r)
    groups: dict[tuple[int, int], list[int]] = {}  # searches whose tensors stack
    for i, search in enumerate(searches):
        groups.setdefault((search.num_beams, search.num_candidates), []).append(i)
    pairs: list[list[tuple[int, int]]] = [[] for _ in searches]
    updates: list[tuple] = [() for _ in searches]
    for members in groups.values():
        group = [searches[i] for i in members]
        stepped = _step_group(group, logprobs, [starts[i] for i in members])
        for i, (chosen, update) in zip(members, stepped):
            pairs[i], updates[i] = chosen, update
    # every search's next state first, then all of them at once: a step that fails leaves
    # every search as it was (the engine then steps each alone, to fail only the faulty)
    for search, update in zip(searches, updates):
        _commit(search, update)
    return pairs


def _step_group(searches: list[BeamSearch], logprobs: torch.Tensor,
                starts: list[int]) -> list[tuple[list[tuple[int, int]], tuple]]:
    """One step of searches with one ``num_beams`` and ``num_candidates``; search ``g``'s
    processed log-probabilities are rows ``starts[g]`` onwards of ``logprobs``. Returns each
    search's pairs and its next state, which `_commit` gives it."""
    beams, num_candidates = searches[0].num_beams, searches[0].num_candidates
    num, vocab = len(searches), logprobs.shape[1]
    # transformers expands the prompt to num_beams identical rows; the -1e9 of beams
    # 1.. keeps them out of the way unless too few tokens are possible (forced ones).
    index = [start + (0 if s.num_rows == 1 else b)
             for s, start in zip(searches, starts) for b in range(beams)]
    running = torch.stack([s._running_scores for s in searches])
    total = (logprobs[index].view(num, beams, vocab) + running[:, :, None]).view(num, -1)
    top_scores, top_index = torch.topk(total, num_candidates, dim=1)
    lengths = [s.num_new_tokens + 1 for s in searches]
    parents, tokens, ends = [], [], []
    for s, length, top in zip(searches, lengths, top_index.tolist()):
        p, t = zip(*(divmod(i, vocab) for i in top))
        parents.append(p)
        tokens.append(t)
        ends.append([tok in s.eos_token_ids or length >= s.max_new_tokens for tok in t])

    # Next running beams: the best candidates that do not end (the small lists here are
    # plain Python; every sum, division and ordering stays a float32 torch op, as in
    # transformers, so ties break alike).
    alive_scores = top_scores + _penalties(ends)
    keep = torch.topk(alive_scores, beams, dim=1).indices
    running = alive_scores.gather(1, keep)

    # transformers' `_update_finished_beams`: only the first num_beams candidates may finish
    # (the rest are spares for the running beams). NOTE: transformers also bars new
    # finishes once its heuristic says no improvement is possible, or with
    # early_stopping=True once all slots are full; for one request both mean the search is
    # already done, so those terms only matter in its batch.
    just_finished = [[end and i < beams for i, end in enumerate(e)] for e in ends]
    divisors = torch.tensor([[length ** s.length_penalty]
                             for s, length in zip(searches, lengths)])
    scores = top_scores / divisors + _penalties([[not f for f in j] for j in just_finished])
    merged = torch.cat((torch.stack([s._finished_scores for s in searches]), scores), dim=1)
    pick = torch.topk(merged, beams, dim=1).indices
    finished = merged.gather(1, pick)

    # transformers' `_check_early_stop_heuristic`: can the best running beam still beat the
    # worst finished slot? ("never" judges it at max_new_tokens when length_penalty > 0)
    best_lengths = [s.max_new_tokens if s.early_stopping == "never" and s.length_penalty > 0.0
                    else length for s, length in zip(searches, lengths)]
    best_running = (running[:, 0] / torch.tensor(
        [b ** s.length_penalty for s, b in zip(searches, best_lengths)])).tolist()
    lowest = finished.min(dim=1).values.tolist()

    updates, out = [], []  # each search's next state, for `step_searches` to commit
    for g, (s, keep_g, pick_g) in enumerate(zip(searches, keep.tolist(), pick.tolist())):
        candidates = [s._running[p] + [t] for p, t in zip(parents[g], tokens[g])]
        sequences, was_finished = s._finished + candidates, s._is_finished + just_finished[g]
        is_finished = [was_finished[i] for i in pick_g]
        # NOTE: while a slot is empty its -1e9 is the minimum, so any real beam can improve.
        can_improve = any(best_running[g] > (lowest[g] if f else NEG) for f in is_finished)
        all_full = all(is_finished) and s.early_stopping is True
        done = all_full or all(ends[g]) or not can_improve
        updates.append(([candidates[i] for i in keep_g], running[g],
                        [sequences[i] for i in pick_g], finished[g], is_finished, lengths[g],
                        done))
        # all beams of the first step come from the single prompt row
        is_first = s.num_new_tokens == 0
        out.append([] if done else
                   [(0 if is_first else parents[g][i], tokens[g][i]) for i in keep_g])
    return list(zip(out, updates))


def _commit(search: BeamSearch, update: tuple) -> None:
    """Give ``search`` the state `_step_group` worked out for it."""
    (search._running, search._running_scores, search._finished, search._finished_scores,
     search._is_finished, search.num_new_tokens, search.done) = update


def _penalties(flags: list[list[bool]]) -> torch.Tensor:
    """transformers' ``flags * -1e9`` as float32: -1e9 where set, 0 elsewhere."""
    return torch.tensor([[NEG if f else 0.0 for f in row] for row in flags])
