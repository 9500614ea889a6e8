"""The nllb family in the engine: encoder once per sequence, cross-attention K/V in state
slots, decoder over paged KV, several translations (different lengths and target
languages) in one batch, against transformers' greedy `generate`."""

from __future__ import annotations

import pytest
import torch

from heron.core import SamplingParams
from tests.engine_utils import LogitsRecorder, assert_no_leaks, make_engine, run_to_end
from tests.nllb_models import build_nllb, build_tokenizer, corpus
from tests.tiny_models import build_tiny

MAX_NEW_TOKENS = 20  # generate's count: the forced target language is the first of them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb")
    tok = build_tokenizer(directory)
    hf = build_nllb(directory, len(tok))
    words = " ".join(corpus(5, seed=1)).split()
    jobs = []  # (source ids, target language)
    for n, lang in ((3, "fra_Latn"), (8, "deu_Latn"), (20, "fra_Latn"), (12, "deu_Latn")):
        tok.src_lang = "eng_Latn"
        jobs.append((tok(" ".join(words[:n])).input_ids, lang))
    refs = []
    for src, lang in jobs:
        lang_id = tok.convert_tokens_to_ids(lang)
        with torch.no_grad():
            out = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False,
                              forced_bos_token_id=lang_id, max_new_tokens=MAX_NEW_TOKENS,
                              output_logits=True, return_dict_in_generate=True)
        refs.append((out.sequences[0].tolist(), torch.cat(out.logits)))
    return directory, tok, jobs, refs


def translate(engine, tok, jobs):
    recorder = LogitsRecorder(engine)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS - 1, temperature=0.0)
    start = engine.runner.model.cfg.decoder_start_token_id
    for i, (src, lang) in enumerate(jobs):
        engine.add_request(f"t{i}", [start, tok.convert_tokens_to_ids(lang)], params,
                           encoder_prompt=src)
    outs = run_to_end(engine)
    return [outs[f"t{i}"] for i in range(len(jobs))], recorder


@pytest.mark.parametrize("overrides", [
    {},
    {"engine.max_num_seqs": 2},  # sequences join while others decode
    {"engine.num_kv_blocks": 6, "engine.block_size": 4},  # preemption: the encoder reruns
], ids=["one-batch", "staggered", "preempted"])
def test_greedy_translations_match_transformers(tiny, overrides):
    directory, tok, jobs, refs = tiny
    engine = make_engine(directory, **overrides)
    outs, recorder = translate(engine, tok, jobs)
    if "engine.num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    worst, lengths = 0.0, set()
    for out, (ref_seq, ref_logits) in zip(outs, refs):
        assert out.prompt_token_ids + out.outputs[0].token_ids == ref_seq
        lengths.add(len(ref_seq))
        mine = torch.stack([recorder.rows[(out.request_id, pos)]
                            for pos in range(1, len(ref_seq) - 1)])
        worst = max(worst, (mine - ref_logits[1:]).abs().max().item())
    assert worst <= 1e-4, f"max abs logit error {worst:.2e}"
    assert len(lengths) > 1  # some stop at EOS early
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)


def test_encoder_prompts_are_required_exactly_where_there_is_an_encoder(tiny, tmp_path):
    directory, tok, jobs, _ = tiny
    engine = make_engine(directory)
    assert engine.prefix_cache is None  # decoder KV depends on the source
    with pytest.raises(ValueError, match="send an encoder prompt"):
        engine.add_request("no-source", [2, 5], SamplingParams())
    too_long = [5] * (engine.runner.max_encoder_len + 1)
    with pytest.raises(ValueError, match="encodes at most 128"):
        engine.add_request("long", [2, 5], SamplingParams(), encoder_prompt=too_long)
    build_tiny("llama", tmp_path)
    with pytest.raises(ValueError, match="no encoder"):
        make_engine(tmp_path).add_request("x", [5, 6], SamplingParams(), encoder_prompt=[5])
