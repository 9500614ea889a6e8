"""Engine logprobs (`TokenLogprobs`) in the two shapes the OpenAI API uses.

Completions: parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs`` (a dict of
token text to logprob) / ``text_offset`` (where each token's text starts in the response's
text, the same whether streamed or not). Chat: a list of ``{token, logprob, bytes,
top_logprobs}``. A token's text is its own decoding (special tokens included); a token that
is part of a multi-byte character decodes to U+FFFD, as in vLLM, while its ``bytes`` are
its own, so that joining them rebuilds the text, as OpenAI's are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from heron.core.detokenizer import IncrementalDetokenizer
from heron.core.logprobs import TokenLogprobs
from heron.server.responses import (ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                    PromptLogprobs, TopLogprob)

_FLOOR = -9999.0  # JSON has no -inf; vLLM reports impossible tokens the same way


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` spelling: exact even for partial characters."""
    return f"token_id:{token_id}"


class TokenTexts:
    """Cached single-token decodings (logprobs ask for the same few ids over and over)."""

    def __init__(self, tokenizer, max_size: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.max_size = max_size
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False)
                    if self.tokenizer is not None else f"<{token_id}>")
            if len(self._cache) >= self.max_size:
                self._cache.clear()
            self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's own bytes (`Tokenizer.token_bytes`), as OpenAI's ``bytes`` lists
        them: a character split over tokens is their bytes joined."""
        if self.tokenizer is None:
            return list(self(token_id).encode())
        return list(self.tokenizer.token_bytes(token_id))


def completion_logprobs(entries: Sequence[TokenLogprobs | None], text_of: Callable[[int], str],
                        token_ids: Sequence[int], offsets: Sequence[int],
                        into: CompletionLogprobs | None = None,
                        num_top: int | None = None) -> CompletionLogprobs:
    """Append ``entries`` (one per ``token_ids``; None for a first prompt token) and the
    tokens' ``offsets`` into the response's text to ``into``. As in OpenAI's API, a token's
    top logprobs include its own (up to ``logprobs + 1`` entries); ``num_top`` cuts entries
    that hold more alternatives than asked for (prompt entries computed for
    ``prompt_logprobs``)."""
    out = into if into is not None else CompletionLogprobs()
    for token_id, entry, offset in zip(token_ids, entries, offsets, strict=True):
        text = text_of(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        logprob = _finite(entry.logprob)
        out.token_logprobs.append(logprob)
        top = {text_of(t): _finite(lp) for t, lp in entry.top[:num_top]}
        top[text] = logprob  # over another token of the same text (pieces of characters)
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], num_top: int,
                    text_of: Callable[[int], str]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: for each prompt token (None for the first), the token's
    own entry, then the ``num_top`` most likely with ranks 1 to ``num_top`` (the prompt's
    token keeps its own rank when it is among them)."""
    result: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        by_id = {entry.token_id: PromptLogprob(logprob=_finite(entry.logprob), rank=entry.rank,
                                               decoded_token=text_of(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            if token_id not in by_id:
                by_id[token_id] = PromptLogprob(logprob=_finite(logprob), rank=rank,
                                                decoded_token=text_of(token_id))
        result.append(by_id)
    return result


def generated_offsets(entries: Sequence[TokenLogprobs], start: int) -> list[int]:
    """Generated tokens' offsets into a response whose generated text starts at ``start``."""
    return [start + e.text_offset for e in entries]


def prompt_offsets(tokenizer, token_ids: Sequence[int], text: str) -> list[int]:
    """Each prompt token's offset into the prompt's ``text``, decoding as the engine does
    (a character split over tokens starts where its first token does). A token whose text
    is not there (a BOS the tokenizer added) takes the offset without moving it."""
    if tokenizer is None:
        return [0] * len(token_ids)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    offsets, at = [], 0
    for token_id in token_ids:
        offsets.append(at)
        piece = detok.append([token_id])
        if piece and text.startswith(piece, at):
            at += len(piece)
    return offsets


def chat_logprobs(entries: Sequence[TokenLogprobs], text_of: Callable[[int], str],
                  bytes_of: Callable[[int], list[int]]) -> list[ChatTokenLogprob]:
    result = []
    for entry in entries:
        top = [TopLogprob(token=text_of(t), logprob=_finite(lp), bytes=bytes_of(t))
               for t, lp in entry.top]
        result.append(ChatTokenLogprob(token=text_of(entry.token_id),
                                       logprob=_finite(entry.logprob),
                                       bytes=bytes_of(entry.token_id), top_logprobs=top))
    return result
