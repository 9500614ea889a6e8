"""Translation through a real server on a tiny NLLB: /v1/completions (the `openai` client)
and /v1/translations, against transformers' greedy `generate` with ``forced_bos_token_id``;
the language checks; decoder-only and translation requests kept apart."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import transformers

from heron.core.config import ConfigError, load_config
from heron.core.engine import Engine
from heron.server.translation_jobs import check_language_defaults, translation_jobs
from tests.nllb_models import LANGS, build_translator, corpus
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

MAX_TOKENS = 12  # after the forced target code: generate's max_new_tokens is one more
WORDS = " ".join(corpus(6, seed=3)).split()
TEXTS = [" ".join(WORDS[:n]) for n in (3, 7, 12, 20)]
ENG, FRA, DEU = LANGS


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nllb-server")
    tok, hf = build_translator(directory)
    return directory, hf


@pytest.fixture(scope="module")
def server(nllb):
    config = server_config(nllb[0], **{"server.served_model_name": "nllb"})
    with ServerThread(config, Engine(config)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(nllb):
    """transformers' greedy translation of ``text`` (its decoded text), memoised."""
    directory, hf = nllb
    cache: dict[tuple[str, str, str], str] = {}

    def translate(text: str, src: str, tgt: str) -> str:
        if (text, src, tgt) not in cache:
            tok = transformers.NllbTokenizer.from_pretrained(directory, src_lang=src)
            with torch.no_grad():
                out = hf.generate(torch.tensor([tok(text).input_ids]), num_beams=1,
                                  do_sample=False, max_new_tokens=MAX_TOKENS + 1,
                                  forced_bos_token_id=tok.convert_tokens_to_ids(tgt))
            cache[(text, src, tgt)] = tok.decode(out[0], skip_special_tokens=True)
        return cache[(text, src, tgt)]

    return translate


@pytest.fixture(scope="module")
def beam_reference(nllb):
    """transformers' beam search: the decoded texts of its ``n`` best hypotheses."""
    directory, hf = nllb

    def translate(text: str, src: str, tgt: str, n: int = 1, **beams) -> list[str]:
        tok = transformers.NllbTokenizer.from_pretrained(directory, src_lang=src)
        with torch.no_grad():
            out = hf.generate(torch.tensor([tok(text).input_ids]), max_new_tokens=MAX_TOKENS + 1,
                              forced_bos_token_id=tok.convert_tokens_to_ids(tgt),
                              num_return_sequences=n, **beams)
        return [tok.decode(row, skip_special_tokens=True) for row in out]

    return translate


def translate(server, **body):
    status, _, payload = server.http("POST", "/v1/translations",
                                     {"model": "nllb", "max_tokens": MAX_TOKENS, **body})
    return status, json.loads(payload)


def test_sources_are_built_as_nllb_tokenizer_builds_them(server, nllb):
    directory, _ = nllb
    runner = server.async_engine.engine.runner
    texts = [*TEXTS, "", "  spaced  out  ", "Caf\u00e9 \u2713 zzz?"]
    for src in LANGS:
        hf_tok = transformers.NllbTokenizer.from_pretrained(directory, src_lang=src)
        tgt = FRA if src != FRA else DEU
        jobs = translation_jobs(server.app, texts, "input", src, tgt, MAX_TOKENS)
        assert jobs.sources == [hf_tok(text).input_ids for text in texts]
        start = runner.info.extra["decoder_start_token_id"]
        assert jobs.prompts == [[start, hf_tok.convert_tokens_to_ids(tgt)]] * len(texts)
    assert runner.info.extra["language_codes"] == {
        code: hf_tok.convert_tokens_to_ids(code) for code in LANGS}


def test_completions_translate_through_the_openai_client(server, reference):
    client = server.client()
    out = client.completions.create(model="nllb", prompt=TEXTS, max_tokens=MAX_TOKENS,
                                    temperature=0.0,
                                    extra_body={"src_lang": ENG, "tgt_lang": FRA})
    assert [c.text for c in out.choices] == [reference(t, ENG, FRA) for t in TEXTS]
    sources = translation_jobs(server.app, TEXTS, "prompt", ENG, FRA, None).sources
    assert out.usage.prompt_tokens == sum(map(len, sources))
    one = client.completions.create(model="nllb", prompt=TEXTS[1], max_tokens=MAX_TOKENS,
                                    temperature=0.0,
                                    extra_body={"src_lang": DEU, "tgt_lang": ENG,
                                                "num_beams": 1})
    assert one.choices[0].text == reference(TEXTS[1], DEU, ENG)
    stream = client.completions.create(model="nllb", prompt=TEXTS[2], max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True,
                                       extra_body={"src_lang": ENG, "tgt_lang": DEU})
    assert "".join(c.choices[0].text for c in stream) == reference(TEXTS[2], ENG, DEU)


def test_translations_mix_language_pairs_in_one_request(server, reference):
    pairs = [(ENG, FRA), (FRA, DEU), (DEU, ENG), (ENG, DEU)]
    status, body = translate(server, input=TEXTS, src_lang=[s for s, _ in pairs],
                             tgt_lang=[t for _, t in pairs])
    assert status == 200, body
    assert body["object"] == "translation" and body["model"] == "nllb"
    assert [t["index"] for t in body["translations"]] == [0, 1, 2, 3]
    assert [t["text"] for t in body["translations"]] == [
        reference(text, s, t) for text, (s, t) in zip(TEXTS, pairs)]
    assert {t["finish_reason"] for t in body["translations"]} <= {"stop", "length"}
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])
    status, one = translate(server, input=TEXTS[0], src_lang=FRA, tgt_lang=ENG)
    assert status == 200 and one["translations"][0]["text"] == reference(TEXTS[0], FRA, ENG)


def test_concurrent_translations(server, reference):
    jobs = [(text, src, tgt) for text in TEXTS for src, tgt in ((ENG, FRA), (DEU, ENG))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: translate(server, input=[j[0]], src_lang=j[1],
                                                    tgt_lang=j[2]), jobs))
    for (text, src, tgt), (status, body) in zip(jobs, answers):
        assert status == 200, body
        assert body["translations"][0]["text"] == reference(text, src, tgt)


def test_sampling_with_a_seed_repeats(server):
    body = dict(input=TEXTS[:2], src_lang=ENG, tgt_lang=FRA, temperature=1.0, seed=7)
    assert translate(server, **body)[1]["translations"] == \
        translate(server, **body)[1]["translations"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"src_lang": "xx_Yyyy", "tgt_lang": FRA}, 400, "src_lang", "`xx_Yyyy`"),
    ({"src_lang": ENG, "tgt_lang": "ita_Latn"}, 400, "tgt_lang", "`ita_Latn`"),
    ({"src_lang": ENG, "tgt_lang": [FRA, "</s>"], "input": ["a", "b"]}, 400, "tgt_lang[1]",
     "unknown language code `</s>` in `tgt_lang[1]`"),
    ({"src_lang": ENG}, 400, "tgt_lang", "`tgt_lang` is required"),
    ({"tgt_lang": FRA}, 400, "src_lang", "`src_lang` is required"),
    ({"src_lang": [ENG, FRA], "tgt_lang": FRA}, 400, "src_lang", "2 codes for 1"),
    ({"src_lang": ENG, "tgt_lang": FRA, "num_beams": 2, "early_stopping": "soon"}, 400,
     "early_stopping", "early_stopping"),
    ({"src_lang": ENG, "tgt_lang": FRA, "num_beams": 2, "repetition_penalty": 1.2}, 400,
     "repetition_penalty", "not supported with beam search"),
    ({"src_lang": ENG, "tgt_lang": FRA, "num_beams": 0}, 400, "num_beams", "num_beams"),
    ({"src_lang": ENG, "tgt_lang": FRA, "input": []}, 400, "input", "must not be empty"),
    ({"src_lang": ENG, "tgt_lang": FRA, "input": "ka " * 200}, 400, "input", "at most 128"),
    ({"src_lang": ENG, "tgt_lang": FRA, "max_tokens": 500}, 400, "max_tokens",
     "translates into at most 126 tokens"),
    ({"src_lang": ENG, "tgt_lang": FRA, "num_beams": 64}, 400, "num_beams",
     "engine.max_num_seqs"),
    ({"src_lang": ENG, "tgt_lang": FRA, "n": 99}, 400, "n", "server.max_n"),
    ({"src_lang": ENG, "tgt_lang": FRA, "n": 3, "num_beams": 2}, 400, "n", "num_beams"),
    ({"src_lang": ENG, "tgt_lang": FRA, "model": "other"}, 404, "model", "`other`"),
])
def test_translation_errors_name_the_field(server, body, status, param, words):
    got, answer = translate(server, **{"input": TEXTS[0], **body})
    assert got == status, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_completions_errors_on_a_translation_model(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nllb", prompt="ka to", extra_body={
            "src_lang": "xx_Yyyy", "tgt_lang": FRA})
    assert "unknown language code `xx_Yyyy` in `src_lang`" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nllb", prompt="ka to", extra_body={"src_lang": ENG})
    assert e.value.body["param"] == "tgt_lang"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nllb", prompt="ka to", n=3, extra_body={
            "src_lang": ENG, "tgt_lang": FRA, "num_beams": 2})
    assert e.value.body["param"] == "n" and "num_beams" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nllb", prompt="ka to", extra_body={
            "src_lang": ENG, "tgt_lang": FRA, "truncate_prompt_tokens": 2})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    languages = {"src_lang": ENG, "tgt_lang": FRA}
    for extra, param in (({"echo": True}, "echo"), ({"prompt": [5, 6, 7]}, "prompt"),
                         ({"extra_body": {"prompt_logprobs": 0, **languages}},
                          "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": "nllb", "prompt": "ka to",
                                         "extra_body": languages, **extra})
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nllb", messages=[{"role": "user", "content": "hi"}])
    assert "is a translation model" in e.value.message


def test_languages_default_from_the_config(nllb, reference):
    config = server_config(nllb[0], **{"server.served_model_name": "nllb",
                                       "model.src_lang": DEU, "model.tgt_lang": FRA})
    with ServerThread(config, Engine(config)) as s:
        status, body = translate(s, input=TEXTS[1])
        assert status == 200 and body["translations"][0]["text"] == reference(TEXTS[1], DEU, FRA)
        status, body = translate(s, input=TEXTS[1], tgt_lang=ENG)  # a request's code wins
        assert status == 200 and body["translations"][0]["text"] == reference(TEXTS[1], DEU, ENG)
        runner = s.async_engine.engine.runner
    with pytest.raises(ConfigError, match="no language code `ita_Latn`"):
        check_language_defaults(load_config(None, {"model.tgt_lang": "ita_Latn"}).model, runner)


def test_decoder_only_models_refuse_translation(tmp_path):
    build_tiny("llama", tmp_path, std=0.15)
    config = server_config(tmp_path, **{"server.served_model_name": "tiny"})
    engine = Engine(config)
    with pytest.raises(ConfigError, match="not a translation model"):
        check_language_defaults(load_config(None, {"model.src_lang": ENG}).model, engine.runner)
    with ServerThread(config, engine) as s:
        client = s.client()
        for field, value in (("src_lang", ENG), ("tgt_lang", FRA)):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                          extra_body={field: value})
            assert e.value.body["param"] == field
            assert "only for translation models" in e.value.message
        status, _, body = s.http("POST", "/v1/translations", {"input": "hi", "src_lang": ENG,
                                                               "tgt_lang": FRA})
        assert status == 400 and "does not translate" in json.loads(body)["error"]["message"]
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_openapi_lists_translation(server):
    doc = json.loads(server.http("GET", "/openapi.json")[2])
    assert "/v1/translations" in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert {"input", "src_lang", "tgt_lang", "num_beams"} <= set(
        schemas["TranslationRequest"]["properties"])
    assert {"src_lang", "tgt_lang", "num_beams"} <= set(
        schemas["CompletionRequest"]["properties"])
    assert "translations" in schemas["TranslationResponse"]["properties"]


def test_engine_is_idle_afterwards(server):
    translate(server, input=TEXTS, src_lang=ENG, tgt_lang=DEU)
    translate(server, input=TEXTS, src_lang=ENG, tgt_lang="xx_Yyyy")
    m = server.wait_for(lambda m: m["heron_kv_blocks_in_use"] == 0
                        and m["heron_state_slots_in_use"] == 0
                        and m["heron_requests_running"] == 0)
    assert m["heron_kv_blocks_in_use"] == 0 and m["heron_state_slots_in_use"] == 0
    assert m["heron_requests_running"] == 0 and m["heron_requests_waiting"] == 0
    engine = server.async_engine.engine
    assert engine.num_blocks_in_use == 0 and engine.num_state_slots_in_use == 0


def test_beam_search_over_both_routes_matches_generate(server, beam_reference):
    beams = {"num_beams": 4, "length_penalty": 0.6, "early_stopping": "never"}
    langs = [(ENG, FRA), (ENG, DEU), (DEU, FRA), (ENG, FRA)]
    status, body = translate(server, input=TEXTS, src_lang=[s for s, _ in langs],
                             tgt_lang=[t for _, t in langs], **beams)
    assert status == 200, body
    want = [beam_reference(text, s, t, **beams)[0] for text, (s, t) in zip(TEXTS, langs)]
    assert [t["text"] for t in body["translations"]] == want
    out = server.client().completions.create(
        model="nllb", prompt=TEXTS[2], n=2, max_tokens=MAX_TOKENS,
        extra_body={"src_lang": ENG, "tgt_lang": FRA, "num_beams": 3, "early_stopping": True})
    assert [c.text for c in out.choices] == beam_reference(TEXTS[2], ENG, FRA, n=2,
                                                           num_beams=3, early_stopping=True)
    # n best hypotheses of each input (input-major), and min_tokens, on /v1/translations
    beams = {"num_beams": 3, "length_penalty": 1.0, "early_stopping": True}
    status, body = translate(server, input=TEXTS[:2], src_lang=ENG, tgt_lang=FRA, n=2,
                             min_tokens=MAX_TOKENS - 2, **beams)
    assert status == 200, body
    want = [t for text in TEXTS[:2] for t in beam_reference(
        text, ENG, FRA, n=2, min_new_tokens=MAX_TOKENS - 1, **beams)]  # + the forced code
    assert [(t["index"], t["text"]) for t in body["translations"]] == list(enumerate(want))
    free = translate(server, input=TEXTS[:2], src_lang=ENG, tgt_lang=FRA, n=2, **beams)[1]
    assert [t["text"] for t in free["translations"]] != want  # min_tokens mattered
    metrics = server.wait_for(lambda m: m["heron_requests_running"] == 0)
    assert metrics["heron_kv_blocks_in_use"] == metrics["heron_state_slots_in_use"] == 0
