"""BERT encoders from llama.cpp GGUF files: tokenization against transformers' tokenizer,
embeddings against transformers' `BertModel` on the checkpoint the file was written from.

The files are written the way llama.cpp's converter (`convert_hf_to_gguf.py`, BertModel)
writes them: its metadata keys, its vocabulary form (a word's first piece with a leading
``▁``, continuations without ``##``, control tokens as they are), gguf-py's
`SpecialVocab` for the special tokens and gguf-py's tensor name map for the names.
"""

from __future__ import annotations

import json

import gguf
import pytest
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
from tests.tiny_models import CORPUS, ENCODER_COMMON, build_tiny_encoder

Q = gguf.GGMLQuantizationType
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Caf\u00e9 NA\u00cfVE d\u00e9j\u00e0 vu!",
         "\u65e5\u672c\u8a9e and emoji \U0001f680, [SEP] spelled out", "def add(a, b): return a+b",
         "zyzzyva qwxp unseenword", "  spaced\tout\n\nlines  "]


def write_gguf(hf_dir, path, pooling: int | None = gguf.PoolingType.CLS,
               qtype: Q = Q.F32, lowercase: bool | None = None) -> None:
    """``hf_dir``'s BertModel as llama.cpp's converter writes it; 2-D weights in ``qtype``;
    ``lowercase``: the ``normalizer.lowercase`` newer converters write (None: as older
    ones, none)."""
    config = json.loads((hf_dir / "config.json").read_text())
    model = transformers.BertModel.from_pretrained(hf_dir).eval()
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    control = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    # the embedding's rows past the vocabulary are padded with unused "[PAD{i}]" tokens
    # (`get_vocab_base`), which get the word marker as ordinary tokens do
    types = [gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.UNUSED for i in range(config["vocab_size"])]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(config["vocab_size"])]
    tokens = [t if i in control else t[2:] if t.startswith("##") else "\u2581" + t
              for i, t in enumerate(tokens)]
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer)
    if lowercase is not None:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config["num_hidden_layers"])
    for name, tensor in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("_ids"):  # the converter drops these
            continue
        array = tensor.numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if array.ndim == 2 and qtype != Q.F32 and "embd" not in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    model = build_tiny_encoder("bert", tmp_path)
    del model
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
    with pytest.raises(ConfigError, match="reranker"):
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

