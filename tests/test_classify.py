"""Sequence classifiers (`...ForSequenceClassification`): the engine's label probabilities
against transformers' logits on the same token ids, softmax over the labels, or the sigmoid
of a lone label's logit."""

from __future__ import annotations

import pytest
import torch
import transformers

from heron.core.config import ConfigError
from tests.engine_utils import assert_no_leaks, make_engine
from tests.test_embeddings import PROMPTS
from tests.tiny_models import CLASSIFIERS, build_tiny


@pytest.fixture(scope="module", params=list(CLASSIFIERS))
def classifier(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return build_tiny(request.param, path), path


def oracle(model, ids: list[int]) -> torch.Tensor:
    """transformers' probabilities: its logits (the last token's, through the score head)
    softmaxed, or a lone label's through a sigmoid."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.sigmoid() if logits.numel() == 1 else logits.softmax(-1)


def test_probabilities_match_transformers_across_chunks(classifier):
    model, path = classifier
    engine = make_engine(path, **{"engine.max_num_batched_tokens": 16})
    labels = engine.pooler.pooling.labels
    assert labels == tuple(model.config.id2label[i] for i in range(model.config.num_labels))
    probs = engine.embed(PROMPTS)
    assert max(len(engine.tokenizer.encode(p)) for p in PROMPTS) > 3 * 16
    for prompt, p in zip(PROMPTS, probs):
        assert p.shape == (len(labels),)
        torch.testing.assert_close(p, oracle(model, engine.tokenizer.encode(prompt)),
                                   atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_a_classifier_neither_generates_nor_classifies_without_a_head(classifier, tmp_path):
    _, path = classifier
    with pytest.raises(ConfigError, match="classify"):
        make_engine(path, **{"model.task": "generate"})
    build_tiny("llama", tmp_path)
    with pytest.raises(ConfigError, match="sequence-classification"):
        make_engine(tmp_path, **{"model.task": "classify"})


def test_labels_default_as_transformers_names_them(tmp_path):
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    from tests.tiny_models import save_tokenizer
    save_tokenizer(tmp_path)
    assert make_engine(tmp_path).pooler.pooling.labels == ("LABEL_0", "LABEL_1")


@pytest.mark.parametrize("tokens", [["a", "b"], ["a"], ["a", "b", "c"]])
def test_a_causal_lm_classifies_by_its_lm_head_rows(tmp_path, tokens):
    """vLLM's ``classifier_from_token``: [no, yes] gives yes's two-way probability (one
    label, as Qwen3-Reranker serves as a cross-encoder), one token its logit's sigmoid, more
    their softmax; against transformers' next-token logits."""
    model = build_tiny("qwen3", tmp_path, head_dim=32)
    engine = make_engine(tmp_path, **{"model.classifier_from_tokens": tokens})
    ids = [engine.tokenizer.token_to_id(t) for t in tokens]
    assert engine.pooler.pooling.labels == tuple(tokens[1:] if len(tokens) == 2 else tokens)
    for prompt, probs in zip(PROMPTS, engine.embed(PROMPTS)):
        with torch.no_grad():
            logits = model(torch.tensor([engine.tokenizer.encode(prompt)])).logits[0, -1, ids]
        expected = (logits.softmax(-1)[1:] if len(ids) == 2 else
                    logits.sigmoid() if len(ids) == 1 else logits.softmax(-1))
        torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-5)
    assert_no_leaks(engine)


def test_classifier_tokens_need_a_causal_lm_and_its_vocabulary(tmp_path):
    build_tiny("llama-cls", tmp_path / "cls")
    with pytest.raises(ConfigError, match="has no LM head"):
        make_engine(tmp_path / "cls", **{"model.classifier_from_tokens": ["a"]})
    build_tiny("llama", tmp_path)
    with pytest.raises(ConfigError, match='served with model.task = "generate"'):
        make_engine(tmp_path, **{"model.classifier_from_tokens": ["a"],
                                 "model.task": "generate"})
    with pytest.raises(ValueError, match="'no such token' is not a token"):
        make_engine(tmp_path, **{"model.classifier_from_tokens": ["a", "no such token"]})
