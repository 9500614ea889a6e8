"""Tokenizer and chat-template tests against transformers as the oracle.

The GGUF half builds heron's tokenizer from the real default model's metadata and compares it
with transformers' own GGUF tokenizer; the HF-dir half trains a tiny byte-level BPE in the
test, saves it with transformers and reads it back.
"""

from __future__ import annotations

import json
import logging
import sys

import gguf
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from heron.core.chat_template import ChatTemplateError, render_chat_template
from heron.core.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "1234567890 and 3.14159, 2024-11-29, x=42",
    "héllo wörld, ça va? naïve café",
    "中文分词测试，日本語のテキスト，한국어",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 end",
    "   leading spaces, trailing   ",
    "tabs\tand\nnewlines\n\n\n  indented\r\nwindows",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><|im_start|>",
    "I'm sure they'll've done it; don't WORRY's",
    "Ġ is a byte-level marker; so is Ċ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me a joke about 42 😀"}],
    [{"role": "system", "content": "Only system."}],
]


# -- GGUF tokenizer vs transformers' GGUF tokenizer --------------------------------------------
@pytest.fixture(scope="module")
def gguf_pair(default_gguf_path):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(gguf.GGUFReader(default_gguf_path))
    theirs = AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)
    return ours, theirs


def test_gguf_facts(gguf_pair):
    ours, theirs = gguf_pair
    assert ours.vocab_size == len(theirs) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert ours.eos_token_ids == (2,)
    assert ours.add_bos_token is False
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert ours.id_to_token(0) == "<|endoftext|>"
    assert set(theirs.all_special_ids) <= set(ours.all_special_ids)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_decode_match_transformers(gguf_pair, text):
    ours, theirs = gguf_pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_token_bytes_rebuild_the_text(gguf_pair):
    """Byte-level BPE: each token's bytes (pieces of characters included, which decode to
    U+FFFD alone) join into the text's UTF-8; an added special token is its own text."""
    ours, _ = gguf_pair
    split = 0
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text
        split += sum("\ufffd" in ours.decode([i]) for i in ids)
    assert split >= 10
    assert ours.token_bytes(ours.token_to_id("<|im_end|>")) == b"<|im_end|>"


def test_token_bytes_of_a_byte_fallback_sentencepiece():
    """SentencePiece-style BPE (Llama 2, Mistral): ``▁`` marks a space and a character
    missing from the vocabulary falls back to ``<0xNN>`` byte tokens."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)},
             "\u2581": 257, "h": 258, "i": 259, "\u2581h": 260, "\u2581hi": 261}
    backend = RawTokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h"), ("\u2581h", "i")],
                                      byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend, special_tokens={})
    text = "hi 🎉 hi é"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and 1 + 0xF0 in ids  # the emoji went byte by byte
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + text.encode()


def test_gguf_digits_are_split_individually(gguf_pair):
    ours, _ = gguf_pair
    tokens = ours.convert_ids_to_tokens(ours.encode("year 2024"))
    assert tokens[-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_gguf_chat_template_matches_transformers(gguf_pair, messages):
    ours, theirs = gguf_pair
    for add in (True, False):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
        assert ours.apply_chat_template(messages, add_generation_prompt=add, tokenize=True) == \
            theirs.encode(expected, add_special_tokens=False)


TRIMMING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("template", [None, TRIMMING], ids=["smollm2", "trimming"])
@pytest.mark.parametrize("start", ["The capital is", "The capital is ", " Pa"])
def test_continue_final_message_matches_transformers(gguf_pair, template, start):
    ours, theirs = gguf_pair
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": start}]
    expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          add_generation_prompt=False,
                                          continue_final_message=True)
    if template is not None:
        ours = Tokenizer(ours.backend, special_tokens={}, chat_template=template)
    assert ours.apply_chat_template(messages, add_generation_prompt=False,
                                    continue_final_message=True) == expected
    assert expected.rstrip().endswith(start.strip())


def test_continue_final_message_needs_content_the_template_writes(gguf_pair):
    ours, _ = gguf_pair
    with pytest.raises(ChatTemplateError, match="no text content"):
        ours.apply_chat_template([{"role": "assistant", "content": None}],
                                 add_generation_prompt=False, continue_final_message=True)
    hiding = Tokenizer(ours.backend, special_tokens={},
                       chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        hiding.apply_chat_template([{"role": "assistant", "content": "Hi"}],
                                   add_generation_prompt=False, continue_final_message=True)


def test_content_parts_are_joined(gguf_pair):
    ours, _ = gguf_pair
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template([{"role": "user", "content": "a\nb"}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


# -- chat template rendering details -------------------------------------------------------------
def test_no_template_is_a_clear_value_error():
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "hi"}])


def test_template_features():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% endfor %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}"
        "{{ strftime_now('%Y')|length }}{{ dict(a=1)['a'] }}{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>&'é"}, {"role": "user", "content": "x", "name": None}]
    out = render_chat_template(template, messages, special_tokens={"bos_token": "<s>"})
    # tojson neither HTML-escapes nor ASCII-escapes; loop controls and namespaces work
    assert out == '<s>"<b>&\'é""x"241>'
    from transformers.utils.chat_template_utils import render_jinja_template

    expected, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                        bos_token="<s>")
    assert out == expected[0]
    with pytest.raises(ChatTemplateError, match="no tools here"):
        render_chat_template(template, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% if %}", messages)
    # a variable may not replace a function the template calls
    for name in ("namespace", "raise_exception", "range", "cycler"):
        with pytest.raises(ChatTemplateError, match=f"may not be named {name}"):
            render_chat_template(template, messages, **{name: "x"})


def test_template_is_sandboxed():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                             [{"role": "user", "content": "x"}])


# -- HF directory tokenizer vs transformers -----------------------------------------------------
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_backend() -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = ["hello world, the quick brown fox jumps over the lazy dog", "héllo 中文 😀 naïve café",
             "def f(x):\n    return x + 1", "What is the capital of France? Paris."]
    tok.train_from_iterator(lines * 20, trainer)
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "add-bos"])
def hf_pair(request, tmp_path_factory):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tok")
    hf = PreTrainedTokenizerFast(tokenizer_object=_tiny_backend(), bos_token="<s>", eos_token="</s>",
                                 add_bos_token=request.param, chat_template=TINY_TEMPLATE)
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return Tokenizer.from_hf_dir(path), AutoTokenizer.from_pretrained(path), request.param


def test_hf_dir_matches_transformers(hf_pair):
    ours, theirs, add_bos = hf_pair
    assert ours.add_bos_token is add_bos
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    assert ours.eos_token_ids == (1, 3)  # tokenizer EOS first, then generation_config's extras
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert (ids[:1] == [0]) is add_bos
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == \
            theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_truncate_keeps_the_special_tokens_as_transformers_does(hf_pair):
    """Ids of a text cut to ``keep`` equal transformers' ``truncation=True`` encoding: a BOS
    the tokenizer adds stays, whichever side loses tokens; ids without it cut plainly."""
    ours, theirs, _ = hf_pair
    text = TEXTS[2] + TEXTS[3]
    ids = ours.encode(text)
    for side in ("left", "right"):
        theirs.truncation_side = side
        for keep in range(1, 12):
            assert ours.truncate(ids, keep, side) == theirs(text, truncation=True,
                                                            max_length=keep)["input_ids"]
    assert ours.truncate([5, 6, 7], 2) == [6, 7] and ours.truncate([5, 6, 7], 2, "right") == [5, 6]


def test_pairs_encode_and_cut_as_transformers_does(tmp_path):
    """BERT's and RoBERTa's pair templates: ids and token types, whole and cut to each
    ``keep`` from one that holds just the template up (the longer text first), both sides."""
    from transformers import AutoTokenizer

    from tests.tiny_models import save_encoder_tokenizer

    first, second = "the quick brown fox", "jumps over the lazy dog, twice [SEP] or more"
    for roberta in (False, True):
        path = tmp_path / str(roberta)
        save_encoder_tokenizer(path, roberta)
        ours, theirs = Tokenizer.from_hf_dir(path), AutoTokenizer.from_pretrained(path)
        whole = theirs(first, second, return_token_type_ids=True)
        assert ours.encode_pair(first, second) == (whole["input_ids"], whole["token_type_ids"])
        specials = 4 if roberta else 3
        for side in ("left", "right"):
            theirs.truncation_side = side
            for keep in range(specials, len(whole["input_ids"]) + 2):
                cut = theirs(first, second, truncation=True, max_length=keep,
                             return_token_type_ids=True)
                assert ours.encode_pair(first, second, keep, side) == (
                    cut["input_ids"], cut["token_type_ids"]), (roberta, side, keep)
                cut_text = theirs(second, truncation=True, max_length=keep)["input_ids"]
                assert ours.truncate(ours.encode(second), keep, side) == cut_text
        with pytest.raises(ValueError, match=f"{specials} special tokens"):
            ours.encode_pair(first, second, specials - 1)


def test_a_sentencepiece_model_without_its_readers_is_named(tmp_path, monkeypatch):
    """A dir with a sentencepiece model and no tokenizer.json (DeBERTa-v3's ``spm.model``)
    converts through transformers, which needs sentencepiece and protobuf to read it."""
    (tmp_path / "spm.model").write_bytes(b"")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "DebertaV2Tokenizer"}))
    monkeypatch.setitem(sys.modules, "google.protobuf", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install sentencepiece protobuf"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_template_in_config_and_missing_dir(tmp_path):
    assert Tokenizer.from_hf_dir(tmp_path) is None
    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
              "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template == "D"
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)  # no post-processor, no flags


def test_unknown_gguf_pre_tokenizer_warns(caplog):
    from heron.core.tokenizer import _gguf_pre_tokenizer

    with caplog.at_level(logging.WARNING):
        _gguf_pre_tokenizer("some-future-model")
    assert "some-future-model" in caplog.text


# -- a GGUF sentencepiece vocabulary vs sentencepiece --------------------------------------------
def _llama_sentencepiece():
    """A sentencepiece BPE trained as Llama 2's and Mistral 7B's vocabularies are: byte
    fallback, no normalization, whitespace kept, a dummy prefix; Mistral v0.3's
    ``[INST]`` / ``[/INST]`` control pieces."""
    import io

    import sentencepiece as spm

    from tests.tiny_models import CORPUS
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((CORPUS + TEXTS) * 5), model_writer=model, vocab_size=420,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, control_symbols=["[INST]", "[/INST]"],
        unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write_sentencepiece_gguf(sp, path) -> None:
    """``sp``'s vocabulary as llama.cpp's converter writes one (`_create_vocab_sentencepiece`:
    each piece, its score, its type), with the special tokens' ids."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types([
        gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
        if sp.is_control(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
        else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL
        for i in range(sp.get_piece_size())])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_gguf_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """Llama 2's / Mistral 7B's kind of GGUF vocabulary (``tokenizer.ggml.model`` "llama"):
    every text's ids are sentencepiece's own (byte fallback for what no piece spells), a BOS
    first unless asked not, decoding gives the text back; a control token in the text is
    that token, and the text after it gets the space llama.cpp puts after special tokens."""
    pytest.importorskip("sentencepiece")
    sp = _llama_sentencepiece()
    _write_sentencepiece_gguf(sp, tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    fallbacks = 0
    for text in TEXTS + ["characters it never saw: \u2603 \u046c\u046a \U0001d518\U0001d52b"]:
        ids = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [sp.bos_id()] + ids
        assert ours.decode(ids) == sp.decode(ids), text
        fallbacks += sum(sp.is_byte(i) for i in ids)
    assert fallbacks >= 10  # what it never saw went byte by byte
    inst, end = sp.piece_to_id("[INST]"), sp.piece_to_id("[/INST]")
    assert ours.encode("[INST] What is 2+2? [/INST]", add_special_tokens=False) == [
        inst, *sp.encode(" What is 2+2? "), end]
    assert ours.all_special_ids == sorted([sp.unk_id(), sp.bos_id(), sp.eos_id(), inst, end])
