"""Logit adjustments made before sampling: min_tokens bans, logit bias, allowed tokens, bad
words and penalties.

Each function edits ``logits`` in place and does no torch work at all for a batch whose
rows leave it neutral, which is the common case.
"""

from __future__ import annotations

import array

import numpy as np
import torch

from heron.core.device import to_device
from heron.core.sampling_params import SamplingParams
from heron.core.sequence import Sequence


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence],
                     eos_token_ids: tuple[int, ...]) -> None:
    """Forbid the tokens that would end a sequence before it has ``min_tokens`` outputs.

    :param logits: ``[B, V]``; row ``i`` belongs to ``seqs[i]``; edited in place.
    :param seqs: the batch's sequences.
    :param eos_token_ids: the model's end-of-sequence ids.

    While ``seq.num_output_tokens < params.min_tokens`` the row's ``stop_token_ids`` get
    ``-inf``, and so do the EOS ids unless ``params.ignore_eos`` (then EOS does not end the
    sequence, so there is nothing to hold back; vLLM treats it the same way). Ids outside
    ``[0, V)`` are skipped: a token the model cannot emit needs no ban.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(eos_token_ids)
            for token_id in banned:
                if 0 <= token_id < vocab_size:
                    rows.append(i)
                    cols.append(token_id)
    if rows:
        index = to_device([rows, cols], torch.long, logits.device)
        logits[index[0], index[1]] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Add each row's ``params.logit_bias`` (token id -> bias) to its logits.

    The ids must lie in ``[0, V)`` (the engine refuses a request whose ids do not). A
    masked logit (``-inf``, e.g. a min_tokens ban) stays masked whatever its bias.
    """
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, seq in enumerate(seqs):
        for token_id, bias in seq.params.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            biases.append(bias)
    if rows:
        index = to_device([rows, cols], torch.long, logits.device)
        logits.index_put_((index[0], index[1]), to_device(biases, logits.dtype, logits.device),
                          accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask every logit of a row but its ``params.allowed_token_ids`` (ids in ``[0, V)``)."""
    for i, seq in enumerate(seqs):
        allowed = seq.params.allowed_token_ids
        if allowed is not None:
            index = to_device(allowed, torch.long, logits.device)
            kept = logits[i].index_select(0, index)
            logits[i].fill_(float("-inf")).index_copy_(0, index, kept)


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask the token that would complete a row's bad word (``params.bad_words_token_ids``):
    a one-token word's always, a longer word's last token when the output so far ends with
    all its others. Only the output counts: a word the prompt ends in may be completed."""
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        words = seq.params.bad_words_token_ids
        if not words:
            continue
        output = seq.output_token_ids
        for word in words:
            head = len(word) - 1
            if head == 0 or (len(output) >= head and output[len(output) - head:] == word[:-1]):
                rows.append(i)
                cols.append(word[-1])
    if rows:
        index = to_device([rows, cols], torch.long, logits.device)
        logits[index[0], index[1]] = float("-inf")


def has_penalties(params: SamplingParams) -> bool:
    """True when any of the three penalties would change a logit."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply repetition, frequency and presence penalties, with vLLM / OpenAI semantics.

    :param logits: ``[B, V]``; row ``i`` belongs to ``seqs[i]``; edited in place.
    :param seqs: the batch's sequences.

    - ``repetition_penalty`` ``p`` (HF / vLLM): every token that occurs in the prompt or the
      output so far has its logit divided by ``p`` when positive, multiplied by ``p``
      otherwise.
    - ``presence_penalty`` ``r`` (OpenAI): subtract ``r`` once from every token that occurs
      in the output so far (the prompt does not count).
    - ``frequency_penalty`` ``f`` (OpenAI): subtract ``f * count`` where ``count`` is how
      often the token occurs in the output so far.

    The work is proportional to the penalised rows' history lengths, not to ``B * V``: only
    the logits of tokens that occurred are read and written. Token ids ``>= V`` (an
    embedding table larger than the LM head) are skipped, as transformers does.
    """
    rows = [i for i, seq in enumerate(seqs) if has_penalties(seq.params)]
    if rows:
        _penalize(logits, seqs, rows)


def _penalize(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """``apply_penalties`` for the batch rows ``rows``, all with some penalty."""
    vocab_size = logits.shape[1]
    rep_rows = [i for i in rows if seqs[i].params.repetition_penalty != 1.0]
    if rep_rows:
        at = _occurrences(rep_rows, [seqs[i].token_ids for i in rep_rows], vocab_size,
                          logits.device)
        p = _per_row(logits, seqs, "repetition_penalty")[at[0]]
        # NOTE: every write of a token that occurs several times carries the same value,
        # computed from logits read before any write, so the duplicates cannot compound.
        original = logits[at]
        logits[at] = torch.where(original > 0, original / p, original * p)

    out_rows = [i for i in rows
                if seqs[i].params.frequency_penalty or seqs[i].params.presence_penalty]
    if out_rows:
        at = _occurrences(out_rows, [seqs[i].output_token_ids for i in out_rows], vocab_size,
                          logits.device)
        presence = _per_row(logits, seqs, "presence_penalty")[at[0]]
        frequency = _per_row(logits, seqs, "frequency_penalty")[at[0]]
        logits[at] = logits[at] - presence  # once per distinct token, as above
        # accumulate=True makes every occurrence count: f subtracted ``count`` times.
        logits.index_put_(at, -frequency, accumulate=True)


def _per_row(logits: torch.Tensor, seqs: list[Sequence], field: str) -> torch.Tensor:
    """``[B]`` one penalty's value for every row of the batch."""
    return to_device([getattr(seq.params, field) for seq in seqs], logits.dtype,
                     logits.device)


def _occurrences(rows: list[int], token_lists: list[list[int]], vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, token)`` index tensors, one entry per occurrence of a token in a history.

    Built and filtered on the host with numpy, then uploaded: a host-side filter
    costs no device sync, and the flat layout keeps one long prompt from padding the whole
    batch. Converting the Python lists is the floor (~1.5 ms per 100k tokens); a
    per-sequence cache of the prompt part would remove most of it if profiles ask for it.
    """
    # array('q', list) converts in C, faster than numpy or torch on a list of ints.
    packed = array.array("q")
    for tokens in token_lists:
        packed += array.array("q", tokens)
    token_ids = np.frombuffer(packed, dtype=np.int64)
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), [len(t) for t in token_lists])
    if token_ids.size and token_ids.max() >= vocab_size:
        keep = token_ids < vocab_size
        token_ids, row_ids = token_ids[keep], row_ids[keep]
    return (to_device(torch.from_numpy(row_ids), torch.long, device),
            to_device(torch.from_numpy(token_ids), torch.long, device))
