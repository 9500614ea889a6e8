"""The tokenizer: a `tokenizers.Tokenizer` plus the facts about it the engine needs.

Built either from a Hugging Face model directory (``tokenizer.json`` and friends) or from a
GGUF file's metadata (byte-level and sentencepiece BPE, WordPiece and Unigram vocabularies,
see `from_gguf`).
No `transformers` tokenizer runs on the serving path; transformers is only the oracle in
tests (and the converter of last resort for a directory without ``tokenizer.json``).

Contract: `encode` adds special tokens (BOS / EOS) exactly when the model says so
(``add_bos_token`` / the ``tokenizer.json`` post-processor); `decode` is the inverse up to
skipped special tokens; `eos_token_ids` lists every id that ends a generation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from heron.core.chat_template import placeholder_template, render_chat_template

__all__ = ["Tokenizer"]

log = logging.getLogger(__name__)

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's): printable Latin-1 bytes stand
    for themselves, the others for ``chr(256 + i)`` in byte order; inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


class Tokenizer:
    """A `tokenizers.Tokenizer` with its special tokens, chat template and score template.

    ``special_tokens`` maps the named special tokens (``bos_token``, ``eos_token``,
    ``unk_token``, ``pad_token``) to their text; they are also the chat template's variables.
    ``eos_token_ids`` must include the ``eos_token``'s id when there is one (it is added).
    ``score_template`` is the template a cross-encoder's (query, document) pairs are
    rendered with (`apply_score_template`); None: the tokenizer's pair template joins them.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str | None],
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 add_bos_token: bool = False, score_template: str | None = None) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self.score_template = score_template
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        ids = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))  # dedupe, keep order

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # -- encoding and decoding -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS/EOS rule applies."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str, keep: int | None = None,
                    side: str = "right") -> tuple[list[int], list[int]]:
        """Token ids and token types of two texts as one input, the tokenizer's pair
        template around them (what a cross-encoder reads). With ``keep``, at most that
        many: the template's special tokens stay and the texts lose tokens at their ends
        (``side`` "left": their starts), the longer first, as transformers'
        ``truncation=True`` cuts a pair. ValueError when ``keep`` cannot hold the template.
        """
        if keep is None:
            both = self.backend.encode(text, pair)
            return both.ids, both.type_ids
        room = keep - self.backend.num_special_tokens_to_add(True)
        if room < 0:
            raise ValueError(f"{keep} tokens cannot hold the tokenizer's "
                             f"{keep - room} special tokens around a pair")
        first, second = (self.backend.encode(t, add_special_tokens=False) for t in (text, pair))
        sizes = _longest_first(len(first), len(second), room)
        first.truncate(sizes[0], direction=side)
        second.truncate(sizes[1], direction=side)
        both = self.backend.post_process(first, second)
        return both.ids, both.type_ids

    def truncate(self, ids: list[int], keep: int, side: str = "left") -> list[int]:
        """``ids`` cut to their last ``keep`` tokens (``side`` "right": their first). Ids that
        open and close as this tokenizer encodes one text (``[CLS]`` ... ``[SEP]``, a BOS)
        keep those special tokens and lose tokens inside them, as transformers'
        ``truncation=True`` cuts; a ``keep`` too small to hold them cuts plainly."""
        if len(ids) <= keep:
            return ids
        head, tail = self._single_template
        inner = keep - len(head) - len(tail)
        if (inner >= 0 and len(ids) >= len(head) + len(tail) and ids[:len(head)] == head
                and ids[len(ids) - len(tail):] == tail):
            body = ids[len(head):len(ids) - len(tail)]
            body = body[len(body) - inner:] if side == "left" else body[:inner]
            return head + body + tail
        return ids[len(ids) - keep:] if side == "left" else ids[:keep]

    @cached_property
    def _single_template(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after one text's."""
        probe = self.backend.encode("a", add_special_tokens=True)
        text = [i for i, s in enumerate(probe.sequence_ids) if s is not None]
        if not text:
            return [], []
        return probe.ids[:text[0]], probe.ids[text[-1] + 1:]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, exact where decoding it alone is not: a piece
        of a UTF-8 character split over tokens (byte-level BPE, or SentencePiece's
        ``<0xNN>`` byte fallback) decodes to U+FFFD but keeps its own bytes here."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary spells bytes as GPT-2's printable characters."""
        decoder = self.backend.decoder
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the ids `decode` understands)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special added token (what ``skip_special_tokens`` drops)."""
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # -- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's chat template (`ChatTemplateError` if none).

        With ``tokenize`` the prompt is encoded without adding special tokens, as
        transformers does: the template writes any BOS itself.
        """
        text = render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def apply_score_template(self, query: str, document: str, **kwargs: Any) -> str:
        """The text of a pair through `score_template`, as vLLM renders its score
        templates: two messages, roles "query" and "document"; ``kwargs`` are the
        template's other variables. `ChatTemplateError` where there is none or it refuses."""
        return render_chat_template(
            self.score_template,
            [{"role": "query", "content": query}, {"role": "document", "content": document}],
            add_generation_prompt=False, special_tokens=self.special_tokens, **kwargs)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model directory, or None if it has none."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json") or {}
        if (path / "tokenizer.json").is_file():
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        elif config or any((path / n).is_file() for n in ("tokenizer.model", "vocab.json")):
            backend = _convert_with_transformers(path)
        else:
            return None
        special = {name: _token_text(config.get(name)) for name in _NAMED_SPECIAL}
        _ensure_added_tokens(backend, config, special)
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            # transformers' rule: explicit flags (or no post-processor) rebuild the template.
            _set_bos_eos_processor(backend, special, bool(config.get("add_bos_token")),
                                   bool(config.get("add_eos_token")))
        generation = _read_json(path / "generation_config.json") or {}
        eos = generation.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        adds_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids,
                   chat_template=_hf_chat_template(path, config), add_bos_token=adds_bos)

    @classmethod
    def from_gguf(cls, reader: Any, encoder: bool = False) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (``reader``: a `gguf.GGUFReader`).

        Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: GPT-2, Llama 3,
        Qwen, SmolLM, RoBERTa...), sentencepiece BPE ones (``"llama"``: Llama 2, Mistral
        7B), BERT's WordPiece ones (``"bert"``) and sentencepiece Unigram ones (``"t5"``,
        XLM-RoBERTa's) are supported; others raise ValueError. Control tokens (type 3)
        become special tokens, user-defined ones (type 4) plain added tokens. WordPiece and
        Unigram vocabularies, and any with ``encoder`` (the file is an encoder's), get an
        encoder's special tokens around a text and a pair (`_gguf_encoder`); a decoder's
        BPE its BOS and EOS where the file adds them (a BOS by default for "llama", as
        llama.cpp).
        """
        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "bert":
            backend = _gguf_wordpiece(tokens, types, field)
        elif kind == "t5":
            backend = _gguf_unigram(tokens, types, field)
        elif kind == "gpt2":
            backend = _gguf_bpe(tokens, types, field("tokenizer.ggml.merges") or [],
                                field("tokenizer.ggml.pre", "default"))
        elif kind == "llama":
            backend = _gguf_spm(tokens, types, field)
        else:
            raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported "
                             "(byte-level BPE, 'gpt2'; sentencepiece BPE, 'llama'; "
                             "WordPiece, 'bert'; Unigram, 't5')")
        if encoder or kind not in ("gpt2", "llama"):
            return cls._gguf_encoder(backend, tokens, types, field)
        special = {name: _gguf_token(tokens, field, key) for name, key in
                   (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                    ("pad_token", "padding"))}
        # llama.cpp adds a BOS to sentencepiece vocabularies' texts unless the file says not
        add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama"))
        _set_bos_eos_processor(backend, special, add_bos, bool(field("tokenizer.ggml.add_eos_token", False)))
        # End-of-turn / end-of-message tokens (Llama 3: <|eot_id|>, <|eom_id|>) also end generation.
        eos_ids = [i for i in (field("tokenizer.ggml.eot_token_id"), field("tokenizer.ggml.eom_token_id"))
                   if i is not None]
        rerank = field("tokenizer.chat_template.rerank")  # llama.cpp's: {query}, {document}
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids,
                   chat_template=field("tokenizer.chat_template"),
                   add_bos_token=add_bos and special["bos_token"] is not None,
                   score_template=placeholder_template(rerank) if rerank else None)

    @classmethod
    def _gguf_encoder(cls, backend: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                      field) -> Tokenizer:
        """An encoder's tokenizer from ``backend``: its control and unknown tokens special,
        and ``[CLS]`` / ``<s>`` ... ``[SEP]`` / ``</s>`` around a text where the file says
        so (``add_bos_token`` and ``add_eos_token``, or in older files ``add_sep_token``
        for the last); a pair gets the separator again between its texts where
        ``add_sep_token`` says so (RoBERTa's), and its second text is typed 1 where the
        model has two token types."""
        _add_gguf_tokens(backend, tokens, types, special=(2, 3), user=())

        def named(*keys: str) -> list[str]:
            return [t for key in keys if (t := _gguf_token(tokens, field, key))]

        first = named("bos") if field("tokenizer.ggml.add_bos_token", True) else []
        add_sep = field("tokenizer.ggml.add_sep_token", True)
        if (add_eos := field("tokenizer.ggml.add_eos_token")) is None:
            last, between = named("seperator") if add_sep else [], []  # older files
        else:
            last, between = named("eos") if add_eos else [], named("seperator") if add_sep else []
        if first or last:
            typed = ":1" if field("tokenizer.ggml.token_type_count", 1) > 1 else ""
            backend.post_processor = processors.TemplateProcessing(
                single=[*first, "$A", *last],
                pair=[*first, "$A", *last, *between, f"$B{typed}", *(t + typed for t in last)],
                special_tokens=[(t, backend.token_to_id(t)) for t in {*first, *last, *between}])
        return cls(backend, special_tokens={"unk_token": _gguf_token(tokens, field, "unknown"),
                                            "pad_token": _gguf_token(tokens, field, "padding")})


def _gguf_wordpiece(tokens: list[str], types: list[int], field) -> tokenizers.Tokenizer:
    """A BERT WordPiece vocabulary as llama.cpp's converter stores it: a word's first piece
    with a leading ``▁``, continuations bare (``##`` dropped), control tokens as written.
    Tokenizes as BERT's own tokenizer does (its normalizer, lowercasing and stripping accents
    where ``normalizer.lowercase`` says so, or in older files when no ordinary token has a
    capital, as uncased vocabularies have none)."""
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        piece = tok if kind == 3 else tok[1:] if tok.startswith("\u2581") else "##" + tok
        vocab.setdefault(piece, i)
    uncased = field("tokenizer.ggml.normalizer.lowercase")
    if uncased is None:  # older files: an uncased vocabulary has no capitals
        uncased = not any(c.isupper() for t, k in zip(tokens, types) if k == 1 for c in t)
    unk = _gguf_token(tokens, field, "unknown")
    backend = tokenizers.Tokenizer(tokenizers.models.WordPiece(
        vocab, unk_token=unk or "[UNK]", max_input_chars_per_word=100))
    backend.normalizer = tokenizers.normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=uncased)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    backend.decoder = tokenizers.decoders.WordPiece()
    return backend


def _gguf_unigram(tokens: list[str], types: list[int], field) -> tokenizers.Tokenizer:
    """A sentencepiece Unigram vocabulary (``tokenizer.ggml.model == "t5"``, as llama.cpp's
    converter writes XLM-RoBERTa's) with its scores, tokenized as transformers' XLM-RoBERTa
    tokenizer does: the file's precompiled normalization map, whitespace runs removed
    (``remove_extra_whitespaces``), every word marked with ``▁`` (``add_space_prefix``)."""
    charsmap = field("tokenizer.ggml.precompiled_charsmap")
    backend = tokenizers.Tokenizer(tokenizers.models.Unigram(
        list(zip(tokens, field("tokenizer.ggml.scores"))),
        unk_id=field("tokenizer.ggml.unknown_token_id"), byte_fallback=False))
    if charsmap:
        backend.normalizer = tokenizers.normalizers.Precompiled(bytes(b & 0xFF for b in charsmap))
    prepend = "always" if field("tokenizer.ggml.add_space_prefix", True) else "never"
    words = tokenizers.pre_tokenizers.Metaspace(prepend_scheme=prepend)
    backend.pre_tokenizer = (tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.WhitespaceSplit(), words])
        if field("tokenizer.ggml.remove_extra_whitespaces", True) else words)
    backend.decoder = tokenizers.decoders.Metaspace(prepend_scheme=prepend)
    _add_gguf_tokens(backend, tokens, types, special=())
    return backend


def _gguf_spm(tokens: list[str], types: list[int], field) -> tokenizers.Tokenizer:
    """A sentencepiece BPE vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2,
    Mistral 7B, Phi-3...) tokenized as llama.cpp and sentencepiece do: spaces as ``▁``, one
    more first (``add_space_prefix``, which llama.cpp also puts after each special token:
    the normalizer runs on each stretch of text between them), adjacent pieces merged best
    score first (merges ranked by the merged piece's score, the way transformers converts
    these vocabularies), and a character no piece spells as its UTF-8 bytes' ``<0xNN>``
    tokens."""
    scores = field("tokenizer.ggml.scores")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pieces = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
              if k == 1 and vocab[t] == i}
    merges = sorted(((scores[i], -pieces[t[:cut]], -pieces[t[cut:]], t[:cut], t[cut:])
                     for t, i in pieces.items() for cut in range(1, len(t))
                     if t[:cut] in pieces and t[cut:] in pieces), reverse=True)
    unk = _gguf_token(tokens, field, "unknown")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab, [(left, right) for *_, left, right in merges], unk_token=unk, fuse_unk=True,
        byte_fallback=True))
    spaces = tokenizers.normalizers.Replace(" ", "\u2581")
    decode = [tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
              tokenizers.decoders.Fuse()]
    if field("tokenizer.ggml.add_space_prefix", True):
        spaces = tokenizers.normalizers.Sequence(
            [tokenizers.normalizers.Prepend("\u2581"), spaces])
        decode.append(tokenizers.decoders.Strip(" ", 1, 0))  # the space put first
    backend.normalizer = spaces
    backend.decoder = tokenizers.decoders.Sequence(decode)
    # llama.cpp matches its control, unknown and user-defined tokens in a text as they are
    _add_gguf_tokens(backend, tokens, types, special=(2, 3))
    return backend


def _add_gguf_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                     special: tuple[int, ...] = (3,), user: tuple[int, ...] = (4,)) -> None:
    """The file's tokens a text holds as they are: those of the ``special`` types (control:
    3, unknown: 2) as special tokens, of the ``user`` types (user-defined: 4) as plain ones."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k in user])


def _gguf_token(tokens: list[str], field, key: str) -> str | None:
    """The token a GGUF file names by ``tokenizer.ggml.{key}_token_id``, if any."""
    i = field(f"tokenizer.ggml.{key}_token_id")
    return tokens[i] if i is not None and i < len(tokens) else None


def _longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of each text of a pair to keep in ``room``: the shorter whole where
    the longer can take the rest, else half each (the first the smaller half), as the
    tokenizers library's ``longest_first`` truncation decides (what transformers runs)."""
    if n1 + n2 <= room:
        return n1, n2
    short, long_ = sorted((n1, n2))
    long_ = short if short > room else max(short, room - short)
    if short + long_ > room:
        short, long_ = room // 2, room // 2 + room % 2
    return (long_, short) if n1 > n2 else (short, long_)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (as `bytes_to_unicode` in GPT-2's encoder)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# llama.cpp's pre-tokenizer names -> the split regex its merges were learned with.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# GPT-2's own regex, with each digit split off first (StarCoder-style vocabularies).
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
_GPT2_PRES = ("gpt-2", "gpt2", "default", "olmo", "mpt", "jais", "phi-2", "stablelm2", "granite")


def _gguf_pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """(pre-tokenizer, ignore_merges) for llama.cpp's ``tokenizer.ggml.pre`` name."""
    pt = tokenizers.pre_tokenizers
    if pre in _SPLITS:
        split = pt.Split(tokenizers.Regex(_SPLITS[pre]), behavior="isolated")
        # llama.cpp looks whole pre-tokens up in the vocabulary first for Llama 3 (ignore_merges).
        byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
        return pt.Sequence([split, byte_level]), _SPLITS[pre] is _LLAMA3_SPLIT
    if pre in _DIGIT_SPLIT_PRES:
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]), False
    if pre not in _GPT2_PRES:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text like GPT-2 does, "
                    "which may tokenize some text differently from llama.cpp", pre)
    return pt.ByteLevel(add_prefix_space=False), False


def _gguf_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        # Ordinary tokens must be spelled in the byte alphabet; a few files store raw text.
        # Control / user-defined tokens keep their text: they are matched as added tokens.
        if kind not in (3, 4) and not set(tok) <= spelled:
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(pre)
    model = tokenizers.models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                  ignore_merges=ignore_merges)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = tokenizers.decoders.ByteLevel()
    _add_gguf_tokens(backend, tokens, types)
    return backend


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ensure_added_tokens(backend: tokenizers.Tokenizer, config: dict,
                         special: Mapping[str, str | None]) -> None:
    """Add the config's added/special tokens the backend lacks (usually none: tokenizer.json
    lists them), so they are matched whole and skipped on decode like transformers does."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing: list[AddedToken] = []
    for spec in (config.get("added_tokens_decoder") or {}).values():
        if spec.get("content") not in present:
            missing.append(AddedToken(spec["content"], single_word=spec.get("single_word", False),
                                      lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                      normalized=spec.get("normalized", False),
                                      special=spec.get("special", False)))
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    names = list(special.values()) + [_token_text(t) for t in (extra if isinstance(extra, list) else extra.values())]
    for text in names:
        if text and text not in present and all(t.content != text for t in missing):
            missing.append(AddedToken(text, special=True, normalized=False))
    if missing:
        backend.add_tokens(missing)


def _set_bos_eos_processor(backend: tokenizers.Tokenizer, special: Mapping[str, str | None],
                           add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    tokens = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _hf_chat_template(path: Path, config: dict) -> str | None:
    """transformers 5 writes ``chat_template.jinja``; older dirs keep it in the config (a
    string, or a list of named templates of which "default" is the one) or a .json file."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _convert_with_transformers(path: Path) -> tokenizers.Tokenizer:
    """A dir without tokenizer.json (sentencepiece / vocab.json only): let transformers
    convert it once, locally, into a `tokenizers` backend."""
    from transformers import AutoTokenizer  # heavy, and rarely needed

    if any(path.glob("*.model")):  # a sentencepiece model (DeBERTa-v3's spm.model, say)
        try:
            import google.protobuf  # noqa: F401
            import sentencepiece  # noqa: F401
        except ImportError:
            # transformers would go on to guess other formats and fail confusingly
            raise ValueError(f"{path} has no tokenizer.json, and reading its sentencepiece "
                             "model needs the sentencepiece and protobuf packages: pip "
                             "install sentencepiece protobuf") from None
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not hasattr(hf, "backend_tokenizer"):
        raise ValueError(f"{path}: tokenizer cannot be converted to a `tokenizers` backend")
    return hf.backend_tokenizer
