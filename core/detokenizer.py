"""Incremental detokenization for streaming: token ids in, newly completed text out.

Decoding token by token breaks on byte-level BPE: one UTF-8 character (an emoji, most CJK)
may span several tokens, and decoding a prefix of them yields U+FFFD. vLLM's answer, used
here: keep two offsets into the token list, ``prefix_offset`` <= ``read_offset``. Text is
always decoded over the window ``tokens[prefix_offset:]`` and compared with the decode of
``tokens[prefix_offset:read_offset]``; what it adds is new. A window whose decode ends in
U+FFFD is an unfinished character, so nothing is emitted and the offsets stay until a later
token completes it. Decoding a small window (rather than all tokens) keeps each step O(1)
and gives decoders that look at neighbours (e.g. sentencepiece's leading space) context.

Contract: the concatenation of every `append` result and the final `flush` equals the text
the whole output decodes to (for byte-level decoders, exactly
``tokenizer.decode(output_ids, skip_special_tokens)``); no delta ends in a U+FFFD that a
later token completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

# How many prompt tokens the first window starts with: enough context for decoders that
# strip or merge across token boundaries, few enough to stay cheap.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    ``prompt_token_ids`` only provide context for the first window; they are never emitted.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        # NOTE: a trailing U+FFFD means a character is still being spelled; a U+FFFD inside
        # the text is a real invalid byte sequence the model produced and is passed on.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: text still held back (an unfinished character decodes
        to U+FFFD here, as a full decode would show it)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
