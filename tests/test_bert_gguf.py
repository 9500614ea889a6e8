"""Encoders from llama.cpp GGUF files (BERT, DistilBERT, RoBERTa, XLM-RoBERTa, NomicBERT,
ModernBERT; embedders and cross-encoders): tokenization against transformers' tokenizer,
vectors and scores against transformers' model of the checkpoint the file was written from.

The files are written the way llama.cpp's converter (`convert_hf_to_gguf.py`) writes them:
its metadata keys, its vocabulary forms (BERT's WordPiece: a word's first piece with a
leading ``▁``, continuations without ``##``, control tokens as they are; XLM-RoBERTa's
sentencepiece Unigram: fairseq's order, scores, normalizer settings; byte-level BPE with its
merges), gguf-py's `SpecialVocab` for the special tokens and gguf-py's tensor name map for
the names. Run beside llama.cpp's own converter on the same checkpoints, these writers gave
the same value for every key both wrote and bit-identical tensors (the converter adds
``tokenizer.ggml.pre``, which heron does not read for these vocabularies, newer ones
``normalizer.lowercase``, which the tests write too, and ModernBERT's ``rope.scaling.type``
none).
"""

from __future__ import annotations

import io
import json

import gguf
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from heron.core.config import ConfigError
from heron.core.engine import Engine
from tests.engine_utils import assert_no_leaks, make_engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import (CORPUS, ENCODER_COMMON, ENCODERS, build_tiny_encoder,
                               randomise_weights)

Q = gguf.GGMLQuantizationType
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Caf\u00e9 NA\u00cfVE d\u00e9j\u00e0 vu!",
         "\u65e5\u672c\u8a9e and emoji \U0001f680, [SEP] spelled out", "def add(a, b): return a+b",
         "zyzzyva qwxp unseenword", "  spaced\tout\n\nlines  "]
# and what XLM-RoBERTa's NFKC map and literal special tokens change
XLMR_TEXTS = TEXTS + ["\uff46\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48  "
                      "\u2460 \ufb01ne \u216b", "<s> literal </s> and <unk>"]


def _encoder_writer(path, config: dict, pooling: int | None, context: int,
                    arch: str = "bert"):
    """A writer with the metadata llama.cpp's converter writes for an encoder of
    ``config`` (transformers' keys)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    writer.add_token_type_count(config["type_vocab_size"])
    return writer


def _finish(writer, hf_dir, config: dict, state: dict[str, torch.Tensor],
            arch=gguf.MODEL_ARCH.BERT, qtype: Q = Q.F32, position_offset: int = 0,
            merges: bool = False, named: dict[str, torch.Tensor] | None = None) -> None:
    """gguf-py's special tokens (and a BPE vocabulary's ``merges``), then the tensors of
    ``state`` under gguf-py's names for them (the pooler dropped and RoBERTa's position
    rows shifted to start at 0, as the converter does) and those of ``named`` under their
    own; 2-D weights in ``qtype``."""
    gguf.SpecialVocab(hf_dir, load_merges=merges, n_vocab=config["vocab_size"]).add_to_gguf(
        writer)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = [(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor)
               for name, tensor in sorted(state.items())  # as safetensors files keep them
               # the converter drops these
               if not (name.startswith("pooler.") or name.endswith("_ids"))]
    for gguf_name, tensor in tensors + list((named or {}).items()):
        array = tensor.numpy()
        if gguf_name == "position_embd.weight":
            array = array[position_offset:]
        if array.ndim == 2 and qtype != Q.F32 and "embd" not in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocabulary(hf_dir, size: int) -> tuple[list[str], list[int]]:
    """The tokenizer's tokens in id order and their types, as the converter's
    `get_vocab_base` lists them: special tokens control ones, other added tokens
    user-defined, and the embedding's rows past the vocabulary padded with unused
    "[PAD{i}]" tokens."""
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {i: t.special for i, t in tokenizer.added_tokens_decoder.items()}
    types = [gguf.TokenType.CONTROL if added.get(i) else gguf.TokenType.USER_DEFINED
             if i in added else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
             for i in range(size)]
    return [by_id.get(i, f"[PAD{i}]") for i in range(size)], types


def _wordpiece_vocab(writer, hf_dir, vocab_size: int, lowercase: bool | None) -> None:
    """BERT's vocabulary as the converter writes it (`write_gguf`): every token but the
    control ones (the padding too) with the word marker, or without ``##``."""
    tokens, types = _vocabulary(hf_dir, vocab_size)
    writer.add_tokenizer_model("bert")
    writer.add_token_list([t if k == gguf.TokenType.CONTROL else t[2:] if t.startswith("##")
                           else "\u2581" + t for t, k in zip(tokens, types)])
    writer.add_token_types(types)
    if lowercase is not None:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)


def _bpe_vocab(writer, hf_dir, vocab_size: int) -> None:
    """A byte-level BPE vocabulary as the converter writes it (`_set_vocab_gpt2`; the
    merges come with `_finish`'s special vocabulary)."""
    tokens, types = _vocabulary(hf_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def write_gguf(hf_dir, path, pooling: int | None = gguf.PoolingType.CLS,
               qtype: Q = Q.F32, lowercase: bool | None = None) -> None:
    """``hf_dir``'s BertModel as llama.cpp's converter writes it; 2-D weights in ``qtype``;
    ``lowercase``: the ``normalizer.lowercase`` newer converters write (None: as older
    ones, none)."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = _encoder_writer(path, config, pooling, config["max_position_embeddings"])
    _wordpiece_vocab(writer, hf_dir, config["vocab_size"], lowercase)
    model = transformers.BertModel.from_pretrained(hf_dir).eval()
    _finish(writer, hf_dir, config, model.state_dict(), qtype=qtype)


def write_nomic_gguf(model, own_dir, path, pooling: int = gguf.PoolingType.MEAN) -> None:
    """A NomicBertModel (``model``, saved with nomic-embed's own names in ``own_dir``:
    `tests.test_bert.save_as_nomic_checkpoint`, which is what the converter reads) as
    llama.cpp's converter writes it: architecture ``nomic-bert``, its rope base, BERT's
    vocabulary."""
    config = model.config.to_dict()
    writer = _encoder_writer(path, config, pooling,
                             json.loads((own_dir / "config.json").read_text())[
                                 "max_trained_positions"], arch="nomic-bert")
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_key_length(model.config.head_dim)
    writer.add_value_length(model.config.head_dim)
    _wordpiece_vocab(writer, own_dir, config["vocab_size"], True)
    _finish(writer, own_dir, config, safetensors.torch.load_file(own_dir / "model.safetensors"),
            gguf.MODEL_ARCH.NOMIC_BERT)


def write_roberta_gguf(hf_dir, path) -> None:
    """``hf_dir``'s RobertaModel as llama.cpp's converter writes one with a byte-level BPE
    ``tokenizer.json`` (`_set_vocab_gpt2`): the vocabulary in id order, special tokens as
    control ones, the merges, its type count."""
    config = json.loads((hf_dir / "config.json").read_text())
    offset = config["pad_token_id"] + 1
    writer = _encoder_writer(path, config, gguf.PoolingType.MEAN,
                             config["max_position_embeddings"] - offset)
    _bpe_vocab(writer, hf_dir, config["vocab_size"])
    model = transformers.RobertaModel.from_pretrained(hf_dir).eval()
    _finish(writer, hf_dir, config, model.state_dict(), position_offset=offset, merges=True)


def write_xlm_roberta_gguf(hf_dir, path, pooling: int | None = gguf.PoolingType.MEAN) -> None:
    """``hf_dir``'s XLMRobertaModel (or classifier, its labels named) as llama.cpp's
    converter writes it from a ``sentencepiece.bpe.model``: the pieces in fairseq's order
    (``<s> <pad> </s> <unk>``, then sentencepiece's pieces from its id 3 on), their scores
    and types, and the model's normalizer settings."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2
    config = json.loads((hf_dir / "config.json").read_text())
    offset = config["pad_token_id"] + 1
    writer = _encoder_writer(path, config, pooling, config["max_position_embeddings"] - offset)
    spm_file = hf_dir / "sentencepiece.bpe.model"
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_file.read_bytes())
    sp = SentencePieceProcessor(model_file=str(spm_file))
    size = config["vocab_size"]
    tokens, scores = [f"[PAD{i}]" for i in range(size)], [-10000.0] * size
    types = [gguf.TokenType.UNUSED] * size
    for i in range(sp.get_piece_size()):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
                    if sp.is_control(i) else gguf.TokenType.NORMAL)
    control, unknown = gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<s>", "<pad>", "</s>", "<unk>"] + tokens[3:-1])
    writer.add_token_scores([0.0] * 4 + scores[3:-1])
    writer.add_token_types([control, control, control, unknown] + types[3:-1])
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    architecture = config["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(hf_dir).eval()
    if architecture.endswith("ForSequenceClassification"):
        writer.add_classifier_output_labels([config["id2label"][str(i)]
                                             for i in range(len(config["id2label"]))])
    # the converter reads a classifier's encoder without its "roberta." prefix
    state = {n.removeprefix("roberta."): t for n, t in model.state_dict().items()}
    _finish(writer, hf_dir, config, state, position_offset=offset)


def build_xlm_roberta(directory, kind: str = "xlm-roberta"):
    """A tiny XLM-RoBERTa (`ENCODERS` ``kind``: the encoder or a classifier) with a
    sentencepiece Unigram vocabulary (nmt_nfkc normalization) in fairseq's layout, converted
    by transformers as an XLM-RoBERTa checkpoint's is."""
    import sentencepiece as spm

    from tests.nllb_models import corpus
    lines = corpus() + (CORPUS + TEXTS + [XLMR_TEXTS[-2]]) * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=200, model_type="unigram", minloglevel=2,
                                   hard_vocab_limit=False)
    (directory / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    transformers.XLMRobertaTokenizer.from_pretrained(directory).save_pretrained(directory)
    torch.manual_seed(0)
    model_cls, config_cls, extra = ENCODERS[kind]
    encoder = model_cls(config_cls(**{**ENCODER_COMMON, **extra})).eval()
    randomise_weights(encoder, 0.3)
    encoder.save_pretrained(directory)
    return encoder


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT (its uncased WordPiece tokenizer) and its GGUF file."""
    hf_dir = tmp_path_factory.mktemp("bert-hf")
    model = build_tiny_encoder("bert", hf_dir)
    path = tmp_path_factory.mktemp("bert-gguf") / "tiny-bert.gguf"
    write_gguf(hf_dir, path)
    return model, hf_dir, path


def expected_vectors(model, hf_dir, texts, method="cls", dims=None) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for text in texts:
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        vector = {"cls": hidden[0], "mean": hidden.mean(0)}[method]
        out.append(F.normalize(vector[:dims], dim=-1))
    return out


@pytest.mark.parametrize("lowercase", [None, True])
def test_the_wordpiece_vocabulary_tokenizes_as_transformers(bert, lowercase, tmp_path):
    _, hf_dir, path = bert
    if lowercase is not None:
        path = tmp_path / "lowercase.gguf"
        write_gguf(hf_dir, path, lowercase=lowercase)
    engine = make_engine(path)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        assert engine.tokenizer.encode(text) == theirs(text)["input_ids"], text
        assert engine.tokenizer.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False)["input_ids"]
        pair = theirs(text, TEXTS[0], return_token_type_ids=True)
        assert engine.tokenizer.encode_pair(text, TEXTS[0]) == (pair["input_ids"],
                                                                pair["token_type_ids"])
    ids = theirs(TEXTS[0])["input_ids"]
    assert engine.tokenizer.decode(ids, skip_special_tokens=True) == theirs.decode(
        ids, skip_special_tokens=True)


def test_a_cased_vocabulary_keeps_capitals_and_accents(tmp_path):
    """A vocabulary with capitals is a cased model's: no lowercasing, no accent stripping
    (bert-base-cased's tokenizer); an uncased one has none."""
    build_tiny_encoder("bert", tmp_path)  # its tokenizer replaced below
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS + TEXTS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[MASK]", do_lower_case=False).save_pretrained(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    for lowercase in (None, False):
        write_gguf(tmp_path, tmp_path / "cased.gguf", lowercase=lowercase)
        engine = make_engine(tmp_path / "cased.gguf")
        for text in TEXTS:
            assert engine.tokenizer.encode(text) == theirs(text)["input_ids"], text
        assert engine.tokenizer.encode("The") != engine.tokenizer.encode("the")


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0])
def test_embeddings_match_transformers(bert, qtype, tmp_path):
    """The file's weights are the checkpoint's (F32), or its rounding (F16, Q8_0: the
    oracle then reads the same rounded weights, dequantized by gguf-py)."""
    model, hf_dir, path = bert
    if qtype != Q.F32:
        path = tmp_path / f"tiny-bert-{qtype.name}.gguf"
        write_gguf(hf_dir, path, qtype=qtype)
        rounded = {}
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            rounded[t.name] = gguf.quants.dequantize(t.data, t.tensor_type)
        model = transformers.BertModel.from_pretrained(hf_dir).eval()
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, model.config.num_hidden_layers)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if gguf_name in rounded:
                    tensor.copy_(torch.tensor(rounded[gguf_name]).reshape(tensor.shape))
    engine = make_engine(path, **{"engine.max_num_batched_tokens": 64})  # model.task "auto"
    assert engine.pooler.pooling.method == "cls" and engine.pooler.pooling.normalize
    assert engine.runner.num_token_types == 2
    assert engine.runner.info.vocab_size == ENCODER_COMMON["vocab_size"]
    for vector, expected in zip(engine.embed(TEXTS), expected_vectors(model, hf_dir, TEXTS)):
        assert vector.shape == (ENCODER_COMMON["hidden_size"],)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_the_file_s_pooling_type_is_the_default(bert, tmp_path):
    model, hf_dir, _ = bert
    mean = tmp_path / "mean.gguf"
    write_gguf(hf_dir, mean, pooling=gguf.PoolingType.MEAN)
    engine = make_engine(mean)
    assert engine.pooler.pooling.method == "mean"
    for vector, expected in zip(engine.embed(TEXTS[:2]),
                                expected_vectors(model, hf_dir, TEXTS[:2], "mean")):
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    assert make_engine(mean, **{"model.pooling": "cls"}).pooler.pooling.method == "cls"
    # a file without a pooling type is still an encoder (attention.causal false): the
    # family's default, CLS
    bare = tmp_path / "none.gguf"
    write_gguf(hf_dir, bare, pooling=None)
    assert make_engine(bare).pooler.pooling.method == "cls"
    with pytest.raises(ConfigError, match="without an LM head"):
        make_engine(bare, **{"model.task": "generate"})
    rank = tmp_path / "rank.gguf"
    write_gguf(hf_dir, rank, pooling=gguf.PoolingType.RANK)
    with pytest.raises(ConfigError, match="pooling_type rank, but no classifier"):
        make_engine(rank)


def test_the_server_embeds_from_the_file(bert):
    model, hf_dir, path = bert
    config = server_config(path, **{"server.served_model_name": "bge-tiny",
                                    "model.matryoshka_dimensions": True})
    with ServerThread(config, Engine(config)) as server:
        client = server.client()
        reply = client.embeddings.create(model="bge-tiny", input=TEXTS)
        for item, expected in zip(reply.data, expected_vectors(model, hf_dir, TEXTS)):
            torch.testing.assert_close(torch.tensor(item.embedding), expected,
                                       atol=1e-5, rtol=1e-5)
        short = client.embeddings.create(model="bge-tiny", input=TEXTS[:1], dimensions=24)
        torch.testing.assert_close(torch.tensor(short.data[0].embedding),
                                   expected_vectors(model, hf_dir, TEXTS[:1], dims=24)[0],
                                   atol=1e-5, rtol=1e-5)
        tokens = AutoTokenizer.from_pretrained(hf_dir)(TEXTS)["input_ids"]
        assert reply.usage.prompt_tokens == sum(map(len, tokens))



def test_an_xlm_roberta_file_tokenizes_and_embeds_as_transformers(tmp_path):
    """XLM-RoBERTa's Unigram vocabulary (``tokenizer.ggml.model`` "t5"): the file's
    normalization map (NFKC here: full-width letters, ligatures, numerals), whitespace runs
    and literal special tokens as transformers' tokenizer takes them; positions from 0."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    model = build_xlm_roberta(hf_dir)
    write_xlm_roberta_gguf(hf_dir, tmp_path / "tiny-xlmr.gguf")
    engine = make_engine(tmp_path / "tiny-xlmr.gguf")
    assert engine.pooler.pooling.method == "mean" and engine.runner.num_token_types == 0
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    for text in XLMR_TEXTS:
        assert engine.tokenizer.encode(text) == theirs(text)["input_ids"], text
        pair = theirs(text, TEXTS[0], return_token_type_ids=True)
        assert engine.tokenizer.encode_pair(text, TEXTS[0]) == (pair["input_ids"],
                                                                pair["token_type_ids"])
    assert engine.tokenizer.decode(theirs(TEXTS[0])["input_ids"], skip_special_tokens=True
                                   ) == TEXTS[0]
    longest = [[5] * 128]  # the context: 130 positions less RoBERTa's first two
    for ids, vector in zip([theirs(t)["input_ids"] for t in XLMR_TEXTS] + longest,
                           engine.embed([*XLMR_TEXTS, *longest])):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(vector, F.normalize(hidden.mean(0), dim=-1),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embeds at most 128"):
        engine.embed([[5] * 129])
    assert_no_leaks(engine)


def test_a_nomic_bert_file_embeds_as_transformers(tmp_path):
    """nomic-embed-text's files (architecture ``nomic-bert``): q, k and v fused, the SwiGLU
    FFN's gate and up projections, rotary positions at the file's base, its context."""
    from tests.test_bert import save_as_nomic_checkpoint
    model = build_tiny_encoder("nomic-bert", tmp_path / "hf")
    own = tmp_path / "own"
    own.mkdir()
    save_as_nomic_checkpoint(model, own, context=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (own / name).write_text((tmp_path / "hf" / name).read_text())
    write_nomic_gguf(model, own, tmp_path / "tiny-nomic.gguf")
    engine = make_engine(tmp_path / "tiny-nomic.gguf")
    assert engine.pooler.pooling.method == "mean" and engine.max_model_len == 64
    assert engine.runner.num_token_types == 2
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text, vector in zip(TEXTS, engine.embed(TEXTS)):
        ids = theirs(text)["input_ids"]
        assert engine.tokenizer.encode(text) == ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(vector, F.normalize(hidden.mean(0), dim=-1),
                                   atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_a_distilbert_file_without_token_types_embeds_as_transformers(tmp_path):
    """llama.cpp writes DistilBERT as ``bert`` without the token-type rows it lacks."""
    model = build_tiny_encoder("distilbert", tmp_path)
    c = model.config
    config = {"hidden_size": c.dim, "num_hidden_layers": c.n_layers,
              "num_attention_heads": c.n_heads, "intermediate_size": c.hidden_dim,
              "layer_norm_eps": 1e-12, "type_vocab_size": 0, "vocab_size": c.vocab_size}
    writer = _encoder_writer(tmp_path / "distil.gguf", config, gguf.PoolingType.MEAN,
                             c.max_position_embeddings)
    _wordpiece_vocab(writer, tmp_path, c.vocab_size, True)
    _finish(writer, tmp_path, config, model.state_dict())
    assert "token_types.weight" not in {t.name for t in gguf.GGUFReader(
        tmp_path / "distil.gguf").tensors}
    engine = make_engine(tmp_path / "distil.gguf")
    assert engine.runner.num_token_types == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    for text, vector in zip(TEXTS, engine.embed(TEXTS)):
        with torch.no_grad():
            hidden = model(**theirs(text, return_tensors="pt")).last_hidden_state[0]
        torch.testing.assert_close(vector, F.normalize(hidden.mean(0), dim=-1),
                                   atol=1e-5, rtol=1e-5)


def test_an_xlm_roberta_reranker_file_scores_pairs_as_transformers(tmp_path):
    """A cross-encoder's file (bge-reranker-v2-m3's kind): its classifier's dense layer and
    rows (``cls``, ``cls.output``) make it a classifier under model.task "auto", labelled as
    the file says; pairs as transformers' tokenizer pairs them, scored as its model does,
    over HTTP too."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    model = build_xlm_roberta(hf_dir, "xlm-roberta-cls")
    path = tmp_path / "reranker.gguf"
    write_xlm_roberta_gguf(hf_dir, path, pooling=None)
    engine = make_engine(path)
    assert engine.pooler.pooling.labels == ("LABEL_0",)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    query, documents = TEXTS[0], XLMR_TEXTS[1:]
    pairs = [engine.tokenizer.encode_pair(query, d)[0] for d in documents]
    assert pairs == [theirs(query, d)["input_ids"] for d in documents]
    with torch.no_grad():
        expected = model(**theirs([query] * len(documents), documents, padding=True,
                                   return_tensors="pt")).logits.sigmoid()[:, 0]
    torch.testing.assert_close(torch.stack(engine.embed(pairs))[:, 0], expected,
                               atol=1e-5, rtol=1e-5)
    config = server_config(path, **{"server.served_model_name": "reranker"})
    with ServerThread(config, Engine(config)) as server:
        status, _, raw = server.http("POST", "/rerank", {"query": query,
                                                         "documents": documents})
    ranked = json.loads(raw)["results"]
    assert status == 200 and len(ranked) == len(documents)
    for item in ranked:
        assert abs(item["relevance_score"] - expected[item["index"]].item()) < 1e-5


def test_a_bert_classifier_file_without_its_pooler_is_refused(tmp_path):
    """llama.cpp's converter drops BERT's pooler, the dense layer a BERT classifier's head
    starts with, and keeps only the labels' rows: such a file cannot score as the model."""
    model = build_tiny_encoder("bert-cls3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    writer = _encoder_writer(tmp_path / "cls.gguf", config, None,
                             config["max_position_embeddings"])
    _wordpiece_vocab(writer, tmp_path, config["vocab_size"], True)
    writer.add_classifier_output_labels(["neg", "neutral", "pos"])
    state = {n.removeprefix("bert.").replace("classifier.", "classifier.out_proj."): t
             for n, t in model.state_dict().items()}
    _finish(writer, tmp_path, config, state)
    with pytest.raises(ValueError, match="BERT's pooler"):
        make_engine(tmp_path / "cls.gguf")


def test_a_roberta_file_with_a_bpe_vocabulary_embeds_as_transformers(tmp_path):
    """RoBERTa's byte-level BPE (``tokenizer.ggml.model`` "gpt2", as the converter writes
    RoBERTa checkpoints with a ``tokenizer.json``): ``<s>`` ... ``</s>`` around a text,
    ``</s></s>`` between a pair's texts; positions from 0."""
    build_tiny_encoder("roberta", tmp_path)
    # a file does not say its activation: BERT's and RoBERTa's checkpoints use exact GELU
    # (the tiny one's tanh approximation is for the HF tests)
    model = transformers.RobertaModel.from_pretrained(tmp_path, hidden_act="gelu").eval()
    write_roberta_gguf(tmp_path, tmp_path / "roberta.gguf")
    engine = make_engine(tmp_path / "roberta.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    for text, vector in zip(TEXTS, engine.embed(TEXTS)):
        ids = theirs(text)["input_ids"]
        assert engine.tokenizer.encode(text) == ids, text
        assert engine.tokenizer.encode_pair(text, TEXTS[0])[0] == theirs(text, TEXTS[0])[
            "input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(vector, F.normalize(hidden.mean(0), dim=-1),
                                   atol=1e-5, rtol=1e-5)


def write_modernbert_gguf(model, hf_dir, path) -> None:
    """``model`` (a transformers ModernBertModel or classifier, its tokenizer a byte-level
    BPE in ``hf_dir``) as llama.cpp's converter writes it: architecture ``modern-bert``,
    both rope bases, the sliding window and its pattern, the activation."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "modern-bert")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_float32("modern-bert.rope.freq_base_swa",
                       c.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_causal_attention(False)
    writer.add_uint32("modern-bert.classifier.pooling_type",
                      {"cls": gguf.PoolingType.CLS, "mean": gguf.PoolingType.MEAN}[
                          c.classifier_pooling])
    writer.add_sliding_window(c.local_attention)
    writer.add_uint32("modern-bert.attention.sliding_window_pattern",
                      c.global_attn_every_n_layers)
    writer.add_vocab_size(c.vocab_size)
    writer.add_string("modern-bert.hidden_activation", c.hidden_activation)
    _bpe_vocab(writer, hf_dir, c.vocab_size)
    if c.architectures and c.architectures[0].endswith("ForSequenceClassification"):
        writer.add_classifier_output_labels([c.id2label[i] for i in range(c.num_labels)])
    state = {n.removeprefix("model.").replace("classifier.", "classifier.out_proj."): t
             for n, t in model.state_dict().items()}
    _finish(writer, hf_dir, {"vocab_size": c.vocab_size,
                             "num_hidden_layers": c.num_hidden_layers}, state,
            gguf.MODEL_ARCH.MODERN_BERT, merges=True)


@pytest.mark.parametrize("kind", ["modernbert", "modernbert-cls"])
def test_a_modernbert_file_embeds_and_classifies_as_transformers(kind, tmp_path):
    """ModernBERT's files (``modern-bert``): global and sliding-window layers with their
    own rope bases, the GeGLU FFN, the final norm; a classifier's head (dense, GELU, norm,
    labels' rows) pooling as the file says."""
    from tests.tiny_models import save_encoder_tokenizer
    model = build_tiny_encoder(kind, tmp_path)
    save_encoder_tokenizer(tmp_path, roberta=True)  # ModernBERT's own is a byte-level BPE
    model.config.architectures = [type(model).__name__]
    # named labels: llama.cpp's converter takes a ModernBERT classifier only with them
    model.config.id2label = {0: "irrelevant", 1: "relevant"}
    write_modernbert_gguf(model, tmp_path, tmp_path / "modernbert.gguf")
    engine = make_engine(tmp_path / "modernbert.gguf")
    if kind == "modernbert-cls":
        assert engine.pooler.pooling.labels == ("irrelevant", "relevant")
        assert engine.runner.default_pooling == "mean"  # the file's classifier pooling
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    texts = TEXTS + [" ".join(TEXTS)]  # past the local layers' window
    for text, vector in zip(texts, engine.embed(texts)):
        inputs = theirs(text, return_tensors="pt")
        assert engine.tokenizer.encode(text) == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            if kind == "modernbert":
                hidden = model(**inputs).last_hidden_state[0]
                expected = F.normalize(hidden[0], dim=-1)
            else:
                expected = model(**inputs).logits[0].softmax(-1)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
