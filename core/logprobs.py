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
    num_rows, vocab_size = logprobs.shape
    if num_rows == 0:
        return []
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    max_top = min(max(num_top), vocab_size)
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    else:
        top_values_list = top_ids_list = [[] for _ in range(num_rows)]
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids[:k], vals[:k])))
        for t, lp, r, ids, vals, k in zip(token_ids.tolist(), chosen.view(-1).tolist(),
                                          ranks.tolist(), top_ids_list, top_values_list,
                                          num_top)
    ]


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
