"""Logprobs of chosen tokens and their top alternatives, for generated and prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    """What the model thought of one token.

    ``logprob`` is the token's log-probability under the raw distribution (log_softmax of
    the model's logits, before min_tokens, penalties, temperature and filters). ``rank`` is
    the number of vocabulary entries at least as likely as the token: 1 for the most likely,
    and ties count against it (vLLM's convention). ``top`` holds the ``k`` most likely
    ``(token_id, logprob)`` pairs, most likely first; it may or may not contain ``token_id``.
    ``text_offset`` (generated tokens; the engine sets it as it detokenizes) counts the
    characters of the sequence's text decoded before the token. Text is held back while a
    character split over tokens is unfinished, so its pieces share the offset of the text
    they complete.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    text_offset: int = 0


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                          num_top: list[int]) -> list[TokenLogprobs]:
    """Describe ``token_ids[i]`` under row ``i`` of ``logprobs``, with ``num_top[i]`` alternatives.

    :param logprobs: ``[N, V]`` log-probabilities (already normalised per row).
    :param token_ids: ``[N]`` int64, the token to describe in each row, on ``logprobs``' device.
    :param num_top: per row, how many top alternatives to return (0 for none).
    :returns: one ``TokenLogprobs`` per row, in row order.

    All rows share one ``topk`` with the largest ``k`` asked for, and every result crosses
    to the host in a single batch of ``tolist`` calls.
    """
    tensors = token_logprob_tensors(logprobs, token_ids, max(num_top, default=0))
    return describe_token_logprobs(tensors, num_top)


def token_logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor,
                          max_top: int) -> tuple[torch.Tensor, ...]:
    """The device half of `gather_token_logprobs`: ``(token_ids, logprob, rank, top values,
    top ids)`` tensors, the last two ``[N, min(max_top, V)]``; nothing crosses to the host."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_values, top_ids = logprobs.topk(min(max_top, logprobs.shape[1]), dim=-1)
    return token_ids, chosen.view(-1), ranks, top_values, top_ids


def describe_token_logprobs(tensors: tuple[torch.Tensor, ...],
                            num_top: list[int]) -> list[TokenLogprobs]:
    """The host half of `gather_token_logprobs`, on what `token_logprob_tensors` returned
    (on any device)."""
    token_ids, chosen, ranks, top_values, top_ids = (t.tolist() for t in tensors)
    return [TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids[:k], vals[:k])))
            for t, lp, r, ids, vals, k in zip(token_ids, chosen, ranks, top_ids, top_values,
                                              num_top)]


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor | list[int],
                    k: int) -> list[TokenLogprobs]:
    """Logprobs of each prompt token given the tokens before it.

    :param logits: ``[P, V]`` raw logits of ``P`` consecutive prompt positions.
    :param target_ids: ``[P]`` the token that actually follows each position, i.e. the
        prompt shifted left by one. The first prompt token has no predecessor and so no
        entry; the engine reports it as None.
    :param k: number of top alternatives per position (``SamplingParams.prompt_logprobs``).
    :returns: one ``TokenLogprobs`` per position, in order.
    """
    if not isinstance(target_ids, torch.Tensor):
        target_ids = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"prompt_logprobs: {logits.shape[0]} logit rows "
                         f"but {target_ids.shape[0]} target ids")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_token_logprobs(logprobs, target_ids.to(logits.device, torch.long),
                                 [k] * logits.shape[0])
