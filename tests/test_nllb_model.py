"""NLLB (M2M100) model math against transformers: encoder states, teacher-forced decoder
logits (one prefill and token by token through the caches) and greedy translations."""

from __future__ import annotations

import pytest
import torch

from heron.plugins.nllb.config import M2M100Config
from heron.plugins.nllb.model import NllbModel, SequenceKV
from tests.nllb_models import build_nllb, build_translator, corpus, heron_model

pytest.importorskip("sentencepiece")

MAX_NEW_TOKENS = 20
TOL = 1e-4  # float32, abs


def _sources(tok) -> list[torch.Tensor]:
    """Three source sentences of 3, 8 and 20 words, NLLB-tokenized: ``[eng_Latn .. </s>]``."""
    lines = corpus(5, seed=1)
    words = " ".join(lines).split()
    return [torch.tensor(tok(" ".join(words[:n])).input_ids) for n in (3, 8, 20)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb")
    tok, hf = build_translator(directory)
    ours = heron_model(directory)
    return tok, hf, ours, _sources(tok)


def _greedy(model: NllbModel, src: torch.Tensor, tgt_lang_id: int) -> list[int]:
    """NLLB's greedy translation: decoder starts from ``decoder_start_token_id`` (EOS) with
    the target language forced as the first generated token, which counts as a new token."""
    cfg = model.cfg
    cross = model.cross_kv(model.encode(src))
    kv = SequenceKV.allocate(cfg, MAX_NEW_TOKENS + 1, src.device, model.dtype)
    out = [cfg.decoder_start_token_id, tgt_lang_id]
    logits = model.decode(torch.tensor(out), torch.arange(2), kv, cross, last_only=True)
    while len(out) < MAX_NEW_TOKENS + 1 and out[-1] not in cfg.eos_token_ids:
        out.append(int(logits[-1].argmax()))
        logits = model.decode(torch.tensor(out[-1:]), torch.tensor([len(out) - 1]), kv, cross)
    return out


def test_config_reads_the_checkpoint(tiny):
    tok, hf, ours, _ = tiny
    cfg = ours.cfg
    assert (cfg.d_model, cfg.num_encoder_layers, cfg.num_decoder_layers) == (64, 2, 2)
    assert (cfg.pad_token_id, cfg.decoder_start_token_id, cfg.eos_token_ids) == (1, 2, (2,))
    assert cfg.vocab_size == len(tok) and not cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(8.0)
    assert ours.unused_tensors == []  # untied: `model.shared.weight` is taken and unused


def test_encoder_matches_transformers(tiny):
    _, hf, ours, sources = tiny
    assert len({len(s) for s in sources}) == 3
    for src in sources:
        with torch.no_grad():
            ref = hf.model.encoder(input_ids=src[None]).last_hidden_state[0]
        got = ours.encode(src)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOL


def test_teacher_forced_logits_prefill_and_incremental(tiny):
    tok, hf, ours, sources = tiny
    cfg = ours.cfg
    fra = tok.convert_tokens_to_ids("fra_Latn")
    for i, src in enumerate(sources):
        # a target of 12 tokens: start, language code, then source pieces as "translation"
        tgt = torch.cat([torch.tensor([cfg.decoder_start_token_id, fra]), sources[-1][1:11]])
        with torch.no_grad():
            ref = hf(input_ids=src[None], decoder_input_ids=tgt[None]).logits[0]
        cross = ours.cross_kv(ours.encode(src))
        assert [k.shape for k, _ in cross] == [(len(src), 4, 16)] * cfg.num_decoder_layers
        kv = SequenceKV.allocate(cfg, 32, src.device, torch.float32)
        prefill = ours.decode(tgt, torch.arange(len(tgt)), kv, cross)
        assert kv.length == len(tgt)
        assert (prefill - ref).abs().max().item() < TOL
        # prefill a prompt of i + 1 tokens, then one token at a time
        kv = SequenceKV.allocate(cfg, 32, src.device, torch.float32)
        steps = [ours.decode(tgt[:i + 1], torch.arange(i + 1), kv, cross)]
        steps += [ours.decode(tgt[t:t + 1], torch.tensor([t]), kv, cross)
                  for t in range(i + 1, len(tgt))]
        assert (torch.cat(steps) - ref).abs().max().item() < TOL


def test_greedy_matches_generate_and_stops_at_eos(tiny):
    tok, hf, ours, sources = tiny
    eos = hf.config.eos_token_id
    lengths = []
    for lang in ("fra_Latn", "deu_Latn"):
        lang_id = tok.convert_tokens_to_ids(lang)
        for src in sources:
            with torch.no_grad():
                ref = hf.generate(src[None], num_beams=1, do_sample=False,
                                  forced_bos_token_id=lang_id,
                                  max_new_tokens=MAX_NEW_TOKENS)[0].tolist()
            assert ref[:2] == [hf.config.decoder_start_token_id, lang_id]
            assert _greedy(ours, src, lang_id) == ref
            lengths.append(len(ref) - 1 if ref[-1] == eos else None)
    assert any(n is not None and n < MAX_NEW_TOKENS for n in lengths), lengths
    assert None in lengths, "no translation ran to max_new_tokens: EOS is too strong"


def test_tied_unscaled_variant_matches_transformers(tmp_path):
    """tie_word_embeddings: one table (`model.shared`) for both stacks and lm_head;
    scale_embedding off."""
    hf = build_nllb(tmp_path, 64, seed=1, tie_word_embeddings=True, scale_embedding=False)
    ours = heron_model(tmp_path)
    cfg = ours.cfg
    assert cfg.tie_word_embeddings and cfg.embed_scale == 1.0 and ours.unused_tensors == []
    src, tgt = torch.tensor([5, 9, 33, 7, 2]), torch.tensor([2, 40, 11, 12, 13])
    with torch.no_grad():
        ref = hf(input_ids=src[None], decoder_input_ids=tgt[None]).logits[0]
    kv = SequenceKV.allocate(cfg, 8, src.device, torch.float32)
    got = ours.decode(tgt, torch.arange(len(tgt)), kv, ours.cross_kv(ours.encode(src)))
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("override, words", [
    ({"activation_function": "gelu"}, "'gelu'"),
    ({"architectures": ["NllbMoeForConditionalGeneration"]}, "NllbMoeForConditionalGeneration"),
    ({"d_model": 66}, "not divisible"),
    ({"pad_token_id": None}, "pad_token_id"),
])
def test_config_refusals(override, words):
    cfg = {"architectures": ["M2M100ForConditionalGeneration"], "d_model": 64,
           "encoder_attention_heads": 4, "decoder_attention_heads": 4, **override}
    with pytest.raises(ValueError, match=words):
        M2M100Config.from_hf(cfg)
