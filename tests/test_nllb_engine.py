"""The nllb family in the engine: encoder once per sequence, cross-attention K/V in state
slots, decoder over paged KV, several translations (different lengths and target
languages) in one batch, against transformers' greedy `generate`."""

from __future__ import annotations

import pytest
import transformers
import torch

from heron.core import SamplingParams
from tests.engine_utils import LogitsRecorder, assert_no_leaks, make_engine, run_to_end
from tests.nllb_models import build_translator, corpus
from tests.tiny_models import build_tiny

MAX_NEW_TOKENS = 20  # generate's count: the forced target language is the first of them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb")
    tok, hf = build_translator(directory)
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


def test_a_slot_keeps_nothing_of_what_it_held(tiny):
    """A new sequence's slot is not zeroed (`zero_fresh=False`): whatever its states held
    before, even NaN, no translation reads it (short sources beside long ones read keys past
    their own, masked, so those rows must be zeros)."""
    directory, tok, jobs, refs = tiny
    engine = make_engine(directory, **{"engine.max_num_seqs": 2})
    for state in engine.cache.states.values():
        state.fill_(float("nan") if state.is_floating_point() else 10**6)
    for round_ in range(2):  # then each slot again, after sources of other lengths
        outs, _ = translate(engine, tok, jobs[::-1] if round_ else jobs)
        expected = refs[::-1] if round_ else refs
        assert [o.prompt_token_ids + o.outputs[0].token_ids for o in outs] == \
            [seq for seq, _ in expected]
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


def test_a_long_source_encodes_over_steps_while_others_decode(tiny):
    """Budget 16: a 100-token source's two encoder layers cost 50 tokens each, so its
    encoder runs a layer per step while the translations already running keep decoding."""
    directory, tok, jobs, _ = tiny
    words = " ".join(corpus(40, seed=3)).split()
    tok.src_lang = "eng_Latn"
    source = tok(" ".join(words[:200])).input_ids[:99] + [tok.eos_token_id]
    lang = tok.convert_tokens_to_ids("deu_Latn")
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([source]), num_beams=1, do_sample=False,
                          forced_bos_token_id=lang, max_new_tokens=MAX_NEW_TOKENS,
                          output_logits=True, return_dict_in_generate=True)
    engine = make_engine(directory, **{"engine.max_num_batched_tokens": 16})
    recorder = LogitsRecorder(engine)
    chunks, encode = [], engine.runner.encode
    engine.runner.encode = lambda batch: (chunks.append(
        [(c.seq.request_id, c.start, c.end) for c in batch]), encode(batch))[1]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS - 1, temperature=0.0)
    start = engine.runner.model.cfg.decoder_start_token_id
    for i, (src, target) in enumerate(jobs[:2]):
        engine.add_request(f"t{i}", [start, tok.convert_tokens_to_ids(target)], params,
                           encoder_prompt=src)
    while len([o for o in engine.step() if o.outputs[0].token_ids]) < 2:
        pass  # until both decode
    engine.add_request("long", [start, lang], params, encoder_prompt=source)
    steps, done = [], {}
    while engine.has_unfinished():
        chunks.append(None)  # marks a step
        outs = engine.step()
        steps.append({o.request_id for o in outs if o.outputs[0].token_ids})
        done.update({o.request_id: o for o in outs if o.finished})
    per_step = " ".join(str(c) for c in chunks).split("None")[1:]
    long_steps = [i for i, text in enumerate(per_step) if "'long'" in text]
    assert long_steps == [0, 1]  # one encoder layer in each of two steps
    assert {"t0", "t1"} <= steps[0] and {"t0", "t1"} <= steps[1]  # nobody stalled
    assert "long" not in steps[0]
    out = done["long"]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    assert tokens == ref.sequences[0].tolist()
    mine = torch.stack([recorder.rows[("long", pos)] for pos in range(1, len(tokens) - 1)])
    assert (mine - torch.cat(ref.logits)[1:]).abs().max().item() <= 1e-4
    assert engine.num_state_slots_in_use == 0
    assert_no_leaks(engine)
