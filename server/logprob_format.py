"""Engine logprobs (`TokenLogprobs`) in the two shapes the OpenAI API uses.

Completions: parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs`` (a dict of
token text to logprob) / ``text_offset``. Chat: a list of ``{token, logprob, bytes,
top_logprobs}``. A token's text is its own decoding (special tokens included); a token that
is part of a multi-byte character decodes to U+FFFD, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from heron.core.logprobs import TokenLogprobs
from heron.server.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob

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


def completion_logprobs(entries: Sequence[TokenLogprobs | None], text_of: Callable[[int], str],
                        token_ids: Sequence[int], text_offset: int,
                        into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Append ``entries`` (one per ``token_ids``; None for a first prompt token) to ``into``.
    Offsets count characters from ``text_offset``, the length of the text already sent."""
    out = into if into is not None else CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = text_of(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry.logprob))
        out.top_logprobs.append({text_of(t): _finite(lp) for t, lp in entry.top})
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs],
                  text_of: Callable[[int], str]) -> list[ChatTokenLogprob]:
    result = []
    for entry in entries:
        text = text_of(entry.token_id)
        top = [TopLogprob(token=text_of(t), logprob=_finite(lp), bytes=list(text_of(t).encode()))
               for t, lp in entry.top]
        result.append(ChatTokenLogprob(token=text, logprob=_finite(entry.logprob),
                                       bytes=list(text.encode()), top_logprobs=top))
    return result
