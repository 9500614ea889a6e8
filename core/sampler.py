"""Turn one step's logits into next tokens, per-request settings applied row by row."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from heron.core import cpu_kernels
from heron.core.device import to_device
from heron.core.grammar import apply_grammar_masks
from heron.core.logprobs import (TokenLogprobs, describe_token_logprobs,
                                 token_logprob_tensors)
from heron.core.penalties import (apply_allowed_tokens, apply_bad_words, apply_logit_bias,
                                  apply_min_tokens, apply_penalties, has_penalties)
from heron.core.sequence import Sequence
from heron.core.thinking import apply_thinking_budgets, budget_spent

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by
# them can overflow to inf and turn the softmax into NaN, and the result would be argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# What a row samples instead of a token: its raw logits were unusable, or its request's own
# restrictions left no token
FAILED, NO_TOKEN = -1, -2

# Floor for the exponential noise: torch's exponential_ can return exactly 0 on some
# backends (pytorch#22557), and 0/0 would make argmax pick a token of probability zero.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SamplerOutput:
    """The sampler's answer for one batch; lists are in row order.

    ``token_ids[i]`` is the token chosen for row ``i``, ``-1`` for a failed row, or ``-2``
    for a row with no token left.
    ``failed_rows`` lists, ascending, the rows whose raw logits were unusable (a NaN or a
    ``+inf`` anywhere, or every entry ``-inf``); ``no_token_rows`` those whose request's own
    restrictions (``allowed_token_ids``, ``bad_words``, its grammar) left no token to pick.
    The engine should finish those sequences with an error instead of emitting a token.
    ``logprobs`` is None when no row asked for logprobs; otherwise ``logprobs[i]`` describes
    ``token_ids[i]`` under the raw distribution with ``params.logprobs`` alternatives, and is
    None for rows that did not ask and for failed rows.
    """

    token_ids: list[int]
    failed_rows: list[int]
    no_token_rows: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None


class PendingSample:
    """A batch's sampled tokens on the device, and their copy on its way to the host.

    ``token_ids``: ``[B]`` int64 on the logits' device, ``-1`` for failed rows; later steps
    may read it on the device before `result` is asked for (the engine's placeholders).
    On CUDA the copy to the host starts at once, without waiting for the stream.
    """

    def __init__(self, token_ids: torch.Tensor, num_logprobs: list[int], logprob_rows: list[int],
                 logprob_tensors: tuple[torch.Tensor, ...]) -> None:
        self.token_ids = token_ids
        self._num_logprobs, self._logprob_rows = num_logprobs, logprob_rows
        self._host = (token_ids, *logprob_tensors)
        self._ready = None
        if token_ids.device.type == "cuda":
            self._host = tuple(t.to("cpu", non_blocking=True) for t in self._host)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SamplerOutput:
        """The tokens on the host (waits for the device to have sampled them)."""
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._host[0].tolist()
        failed_rows = [i for i, t in enumerate(token_ids) if t == FAILED]
        no_token_rows = [i for i, t in enumerate(token_ids) if t == NO_TOKEN]
        if not self._logprob_rows:
            return SamplerOutput(token_ids, failed_rows, no_token_rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        described = describe_token_logprobs(self._host[1:], self._num_logprobs)
        for i, entry in zip(self._logprob_rows, described):
            if token_ids[i] >= 0:
                logprobs[i] = entry
        return SamplerOutput(token_ids, failed_rows, no_token_rows, logprobs)


class Sampler:
    """Samples one token per row, vLLM-compatible in the order settings are applied.

    Per row: raw logprobs for reporting, min_tokens bans, logit bias, allowed tokens, bad
    words, penalties, the structured output's mask, a spent thinking budget, then either
    argmax (greedy rows) or temperature, top-k, top-p, min-p and a draw. A row of a request
    with a seed draws its noise only from ``seq.generator``, so its tokens depend on nothing
    but its own logits and seed: not on batch size, row position or other requests.
    """

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Pick the next token of every sequence: `launch`, then its result.

        :param logits: ``[B, V]`` float32 raw logits; row ``i`` belongs to ``seqs[i]``.
            NOTE: may be edited in place (bans, penalties, temperature, filters); copy it
            first if the raw values are needed afterwards.
        :param seqs: the sequences, each with ``params``; ``generator`` (a
            ``torch.Generator`` on ``logits``' device) when the request has a seed.
        :returns: a ``SamplerOutput`` whose lists have ``B`` entries.
        """
        return self.launch(logits, seqs).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """`sample`'s device work, with no host sync: the tokens stay on the device
        (`PendingSample.token_ids`) and cross to the host when `PendingSample.result` is
        asked for. Reads ``seqs``' histories (penalties, min_tokens) now."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        if all(map(_takes_raw_argmax, seqs)):
            return PendingSample(_checked_argmax(logits), [], [], ())
        logits = logits.float()  # a no-op for the float32 the contract asks for
        # One reduction finds all three ways a row can be unusable: amax is NaN if any entry
        # is NaN, +inf if any is +inf, -inf if every entry is masked.
        is_failed = ~torch.isfinite(logits.amax(dim=-1))
        num_logprobs = [seq.params.logprobs for seq in seqs]
        rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if rows else None

        apply_min_tokens(logits, seqs, self.eos_token_ids)
        apply_logit_bias(logits, seqs)
        apply_allowed_tokens(logits, seqs)
        apply_bad_words(logits, seqs)
        apply_penalties(logits, seqs)
        apply_grammar_masks(logits, seqs)
        apply_thinking_budgets(logits, seqs)
        # NOTE: only these can mask a whole row (top-k, top-p and min-p keep the best token)
        restricted = any(seq.params.allowed_token_ids or seq.params.bad_words_token_ids
                         or seq.grammar is not None for seq in seqs)
        no_token = ~torch.isfinite(logits.amax(dim=-1)) if restricted else None
        chosen = self._choose(logits, seqs)
        if no_token is not None:
            chosen.masked_fill_(no_token, NO_TOKEN)
        chosen.masked_fill_(is_failed, FAILED)
        logprob_tensors = ()
        if rows:  # a failed row's entry is described as token 0, then dropped
            tokens = chosen
            if len(rows) < len(seqs):
                index = to_device(rows, torch.long, logits.device)
                raw_logprobs, tokens = raw_logprobs[index], chosen[index]
            logprob_tensors = token_logprob_tensors(raw_logprobs, tokens.clamp(min=0),
                                                    max(num_logprobs[i] for i in rows))
        return PendingSample(chosen, [num_logprobs[i] for i in rows], rows, logprob_tensors)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``[B]`` int64 tokens: argmax for greedy rows, a draw for the rest."""
        random_rows = [i for i, seq in enumerate(seqs)
                       if seq.params.temperature >= GREEDY_TEMPERATURE_EPS]
        if not random_rows:
            return logits.argmax(dim=-1)
        if len(random_rows) == len(seqs):
            return _draw(logits, seqs)
        index = to_device(random_rows, torch.long, logits.device)
        drawn = _draw(logits.index_select(0, index), [seqs[i] for i in random_rows])
        return logits.argmax(dim=-1).index_copy_(0, index, drawn)


def _takes_raw_argmax(seq: Sequence) -> bool:
    """Whether a row's token is the argmax of its raw logits and nothing else is asked of
    it: greedy, no logprobs, and no setting that edits logits."""
    params = seq.params
    return (params.temperature < GREEDY_TEMPERATURE_EPS and params.logprobs is None
            and not params.logit_bias and params.allowed_token_ids is None
            and not params.bad_words_token_ids and seq.grammar is None
            and not has_penalties(params) and not budget_spent(seq)
            and not (params.min_tokens and seq.num_output_tokens < params.min_tokens))


def _checked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 argmax of each row, ``FAILED`` for an unusable row, in one reduction
    over the logits as they are (bf16 included: the conversion to float32 is exact, so the
    argmax is the same). torch's argmax takes a NaN over anything and ``+inf`` over any
    number, and lands on ``-inf`` only when the whole row is, so the chosen logit is finite
    exactly when the row is usable. float32 rows on the CPU go to a compiled kernel where
    one builds (``ops/kernels/argmax_cpu.cpp``: one vector pass, the same answers)."""
    if logits.is_cpu and logits.dtype is torch.float32 and logits.dim() == 2 and (
            logits.stride(1) == 1 and (lib := _argmax_kernel()) is not None):
        chosen = torch.empty(logits.shape[0], dtype=torch.int64)
        lib.heron_checked_argmax(logits.data_ptr(), logits.stride(0), logits.shape[0],
                                 logits.shape[1], FAILED, chosen.data_ptr())
        return chosen
    return _checked_argmax_ref(logits)


@functools.cache
def _argmax_kernel(vec_floats: int | None = None):
    """The compiled checked argmax, its argument types set; None if not built.
    ``vec_floats`` (8, 16): built for vectors of that many floats, not the machine's."""
    lib = cpu_kernels.load("argmax_cpu.cpp", None, vec_floats)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.heron_checked_argmax.argtypes = [p, i64, i64, i64, i64, p]
    lib.heron_checked_argmax.restype = None
    return lib


def _checked_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    chosen = logits.argmax(dim=-1)
    best = logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return chosen.masked_fill_(~torch.isfinite(best), FAILED)


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sample one token per row from ``logits`` (edited in place) under each row's params."""
    params = [seq.params for seq in seqs]
    vocab_size = logits.shape[1]
    device = logits.device
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits.div_(to_device(temperatures, logits.dtype, device).view(-1, 1))

    # Only rows that ask for top-k or top-p pay for a topk or a sort.
    sort_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
    if sort_rows:
        top_k = [min(params[i].top_k, vocab_size) if params[i].top_k > 0 else vocab_size
                 for i in sort_rows]
        top_p = [params[i].top_p for i in sort_rows]
        if len(sort_rows) == len(seqs):
            _apply_top_k_top_p(logits, top_k, top_p)
        else:
            index = to_device(sort_rows, torch.long, device)
            sub = logits.index_select(0, index)
            _apply_top_k_top_p(sub, top_k, top_p)
            logits.index_copy_(0, index, sub)

    min_p = [p.min_p for p in params]
    if any(min_p):
        _apply_min_p(logits, min_p)

    probs = logits.softmax(dim=-1)
    return _draw_from(probs, [seq.generator for seq in seqs])


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Mask (in place, to ``-inf``) what top-k and then top-p remove.

    ``top_k[i]`` in ``[1, V]`` (``V`` = off): keep tokens at least as large as the k-th
    largest logit, so ties at the boundary survive (as vLLM). ``top_p[i]`` in ``(0, 1]``:
    keep the smallest most-likely-first set whose probability, renormalised after top-k,
    reaches ``top_p``; the most likely token always stays.
    """
    device = logits.device
    k = to_device(top_k, torch.long, device).view(-1, 1)
    if all(p >= 1.0 for p in top_p):
        # Top-k alone needs only each row's k-th largest value: topk, not a full sort.
        kth_largest = logits.topk(max(top_k), dim=-1).values.gather(1, k - 1)
        logits.masked_fill_(logits < kth_largest, float("-inf"))
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth_largest = sorted_logits.gather(1, k - 1)
    remove = sorted_logits < kth_largest
    sorted_logits.masked_fill_(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
    # Rows with top_p == 1 get an unreachable threshold: rounding in the cumsum could
    # otherwise push the tail's mass_before to 1.0 and cut tokens nobody asked to cut.
    p = to_device([x if x < 1.0 else float("inf") for x in top_p], logits.dtype,
                  device).view(-1, 1)
    remove |= mass_before >= p
    logits.masked_fill_(torch.empty_like(remove).scatter_(1, order, remove), float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Mask tokens whose probability is below ``min_p[i]`` times the row's top probability.

    Compared in logit space, ``l - l_max < log(min_p)``, so no softmax is needed; ``min_p``
    of 0 gives ``log = -inf`` and masks nothing. Probability ratios do not change when
    top-k / top-p renormalise and the top token always survives them, so running this after
    them equals running it on the temperature-scaled distribution.
    """
    log_min_p = to_device(min_p, logits.dtype, logits.device).log().view(-1, 1)
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    logits.masked_fill_(logits < threshold, float("-inf"))


def _draw_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row with ``P(token) = probs[row, token]``; ``probs`` may be overwritten.

    Rows with a generator draw their randomness from it alone, a fixed amount per step
    whatever the batch, so a seeded request is reproducible; the other rows share one
    batched draw from the default generator.
    """
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if probs.device.type == "cpu":
        return _inverse_cdf(probs, seeded, len(seeded) < len(generators))
    return _exponential_race(probs, seeded, len(seeded) < len(generators))


def _inverse_cdf(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]],
                 has_unseeded: bool) -> torch.Tensor:
    """The first token whose cumulative probability reaches ``u * total``, ``u`` in ``(0, 1]``.

    One uniform per row instead of ``V`` exponentials: on the CPU the random numbers are
    what an exponential race spends its time on (about 10x a cumsum).
    NOTE: exact only with the CPU's sequential cumsum, which leaves a zero-probability
    token's entry equal to its predecessor's, so it can never be the first to reach the
    target; a parallel scan may round the two differently, hence the race on other devices.
    """
    u = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    if has_unseeded:
        u.uniform_()
    for i, generator in seeded:
        u[i].uniform_(generator=generator)
    cdf = probs.cumsum(dim=-1)
    # 1 - u lies in (0, 1]: the target is above 0 (a leading zero-probability token cannot
    # match it) and at most the total (some token always does).
    target = (1.0 - u) * cdf[:, -1:]
    # The clamp only matters for NaN rows, which are reported failed anyway.
    return torch.searchsorted(cdf, target).view(-1).clamp_(max=probs.shape[1] - 1)


def _exponential_race(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]],
                      has_unseeded: bool) -> torch.Tensor:
    """``argmax(probs / q)`` with ``q ~ Exp(1)`` per token: elementwise, so any device runs it."""
    noise = torch.empty_like(probs)
    if has_unseeded:
        noise.exponential_()
    for i, generator in seeded:
        noise[i].exponential_(generator=generator)
    noise.clamp_min_(_MIN_NOISE)
    return probs.div_(noise).argmax(dim=-1)
