"""Every endpoint through a real server and the official `openai` client, on a tiny model."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import structlog
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def server(tmp_path_factory, request):
    """With and without async scheduling (each token reaches its stream a step later)."""
    path = tmp_path_factory.mktemp("tiny-api")
    build_tiny("llama", path, std=0.15)
    config = server_config(path, **{"server.served_model_name": "tiny",
                                    "engine.async_scheduling": request.param})
    with ServerThread(config, Engine(config)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.async_engine.engine.tokenizer


def extra(**kw):
    """vLLM's sampling fields travel in ``extra_body`` with the openai client."""
    return {"extra_body": kw}


def completion(client, **kw):
    args = {"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "max_tokens": 12,
            "extra_body": {"ignore_eos": True}, **kw}
    return client.completions.create(**args)


def test_models_health_openapi(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].object == "model"
    assert client.models.retrieve("tiny") == models[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other/model")
    assert missing.value.body["code"] == "model_not_found" and "other/model" in str(missing.value)
    assert server.http("GET", "/health")[:1] == (200,)
    status, _, body = server.http("GET", "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
            "/detokenize", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    assert doc["security"] == [{"bearer": []}] and "bearer" in doc["components"]["securitySchemes"]
    assert doc["paths"]["/health"]["get"]["security"] == []  # open routes say so
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "logprobs", "echo", "top_k", "min_p"} <= set(schema["properties"])
    listing = doc["paths"]["/v1/responses/{response_id}/input_items"]["get"]["parameters"]
    assert [(p["name"], p["in"]) for p in listing] == [
        ("response_id", "path"), ("after", "query"), ("limit", "query"), ("order", "query")]
    assert listing[2]["schema"]["maximum"] == 100
    retrieve = doc["paths"]["/v1/responses/{response_id}"]["get"]["parameters"]
    assert {p["name"] for p in retrieve if p["in"] == "query"} == {"stream", "starting_after"}


def test_completion_prompt_forms_and_usage(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    single = completion(client)
    assert single.object == "text_completion" and single.choices[0].finish_reason == "length"
    assert single.usage.prompt_tokens == len(ids)
    assert single.usage.completion_tokens == 12
    assert single.usage.total_tokens == len(ids) + 12
    assert single.usage.prompt_tokens_details.cached_tokens == 0
    # token ids, a list of strings and a list of token-id lists give the same text
    assert completion(client, prompt=ids).choices[0].text == single.choices[0].text
    many = completion(client, prompt=[PROMPT, "def add"])
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == single.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("def add"))
    by_ids = completion(client, prompt=[ids, tokenizer.encode("def add")])
    assert [c.text for c in by_ids.choices] == [c.text for c in many.choices]


def test_completion_n_seed_and_sampling_fields(client):
    kw = dict(temperature=1.0, n=3, seed=7, max_tokens=10, extra_body={"ignore_eos": True})
    first, again = completion(client, **kw), completion(client, **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 30
    # any signed 64-bit seed, as vLLM takes (clients hash into one)
    for seed in (-1, -2**63, 2**63 - 1):
        kw["seed"] = seed
        first, again = completion(client, **kw), completion(client, **kw)
        assert [c.text for c in first.choices] == [c.text for c in again.choices]
    vllm = completion(client, temperature=0.8, seed=1, max_tokens=8,
                      extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                  "min_tokens": 8, "ignore_eos": True})
    assert vllm.usage.completion_tokens == 8


def test_completion_stop_and_stop_token_ids(client, tokenizer):
    full = completion(client, logprobs=0, max_tokens=16)
    text = full.choices[0].text
    stop = text[4:6]
    cut = completion(client, stop=[stop], max_tokens=16).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert cut.stop_reason == stop
    as_ids = completion(client, logprobs=0, max_tokens=16,
                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    generated = [int(t.removeprefix("token_id:")) for t in as_ids.choices[0].logprobs.tokens]
    assert tokenizer.decode(generated) == text
    stop_id = generated[2]
    by_id = completion(client, max_tokens=16, extra_body={"ignore_eos": True,
                                                          "stop_token_ids": [stop_id]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens <= 3


def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_raw(client):
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def ids_of(choice):
        return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]

    full = completion(client, logprobs=5, max_tokens=6, extra_body=as_ids).choices[0]
    first = ids_of(full)[0]
    banned = completion(client, logprobs=0, max_tokens=6, logit_bias={str(first): -100},
                        extra_body=as_ids).choices[0]
    assert ids_of(banned)[0] != first
    # the runner-up of the first step, forced at every step; its logprob is the raw one
    runner_up, raw = sorted(full.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[1]
    forced_id = int(runner_up.removeprefix("token_id:"))
    forced = completion(client, logprobs=0, max_tokens=6, logit_bias={str(forced_id): 100},
                        extra_body=as_ids).choices[0]
    assert ids_of(forced) == [forced_id] * 6
    assert forced.logprobs.token_logprobs[0] == pytest.approx(raw, abs=1e-5)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.0, logit_bias={str(forced_id): 100}, logprobs=True,
        extra_body=as_ids).choices[0]
    assert [int(c.token.removeprefix("token_id:")) for c in chat.logprobs.content] == [forced_id] * 4


def test_completion_logprobs_and_echo(server, client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = completion(client, logprobs=3, echo=True).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(ids) + 12 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # up to logprobs + 1: the token's own logprob is always there
    for t, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 4 and top[t] == v, (t, v, top)
    assert out.text.startswith(PROMPT)
    assert out.text == PROMPT + completion(client).choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    # max_tokens 0 with echo scores the prompt only, and generates nothing in the metrics
    generated = 'heron_tenant_tokens_total{kind="generated",tenant=""}'
    before = server.metrics()
    scored = completion(client, logprobs=1, echo=True, max_tokens=0)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    after = server.metrics()
    assert after["heron_generation_tokens_total"] == before["heron_generation_tokens_total"]
    assert after[generated] == before[generated]
    assert after["heron_prompt_tokens_total"] == before["heron_prompt_tokens_total"] + len(ids)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]


def _reference_prompt_logprobs(server, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position of the served tiny model."""
    model = AutoModelForCausalLM.from_pretrained(server.config.model.path,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(entries, ids, ref, k, tokenizer):
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row, own = ref[i - 1], ids[i]
        keys = [int(key) for key in entry]
        assert keys[0] == own  # the prompt's token first, with its true rank
        assert entry[str(own)]["logprob"] == pytest.approx(row[own].item(), abs=1e-4)
        assert entry[str(own)]["rank"] == int((row >= row[own]).sum())
        top = row.topk(k).indices.tolist()
        assert set(keys) == {own, *top} and len(entry) in (k, k + 1)
        for rank, token in enumerate(top, start=1):
            got = entry[str(token)]
            assert got["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert got["decoded_token"] == tokenizer.decode([token])
            assert got["rank"] == rank or token == own


def test_prompt_logprobs_match_transformers(server, client, tokenizer):
    """vLLM's ``prompt_logprobs``: each prompt token's logprob and rank and the k most likely
    in its place, keyed by token id, in each choice (completions) or the response (chat);
    checked against transformers on the served weights."""
    prompts = [PROMPT, "def add(a, b):"]
    refs = {p: _reference_prompt_logprobs(server, tokenizer.encode(p)) for p in prompts}
    out = completion(client, prompt=prompts, n=2, max_tokens=2,
                     extra_body={"ignore_eos": True, "prompt_logprobs": 3})
    assert len(out.choices) == 4
    for c in out.choices:
        prompt = prompts[c.index // 2]
        _check_prompt_logprobs(c.prompt_logprobs, tokenizer.encode(prompt), refs[prompt], 3,
                               tokenizer)
    # with echo, the echoed logprobs keep to `logprobs` alternatives
    echoed = completion(client, logprobs=1, echo=True, max_tokens=0,
                        extra_body={"prompt_logprobs": 4}).choices[0]
    assert all(len(top) <= 2 for top in echoed.logprobs.top_logprobs[1:])
    _check_prompt_logprobs(echoed.prompt_logprobs, tokenizer.encode(PROMPT), refs[PROMPT], 4,
                           tokenizer)
    assert completion(client, max_tokens=1).choices[0].model_extra.get("prompt_logprobs") is None

    messages = [{"role": "user", "content": "Hello"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                            extra_body={"prompt_logprobs": 0})
    ids = json.loads(server.http("POST", "/tokenize", {"model": "tiny",
                                                       "messages": messages})[2])["tokens"]
    assert answer.usage.prompt_tokens == len(ids)
    _check_prompt_logprobs(answer.prompt_logprobs, ids, _reference_prompt_logprobs(server, ids),
                           0, tokenizer)
    for create, args in ((client.completions.create, {"prompt": PROMPT}),
                         (client.chat.completions.create, {"messages": messages})):
        with pytest.raises(openai.BadRequestError) as streamed:
            create(model="tiny", stream=True, extra_body={"prompt_logprobs": 1}, **args)
        assert streamed.value.body["param"] == "prompt_logprobs"


def _generate_beams(server, ids: list[int], num_beams: int, n: int, max_tokens: int,
                    **settings) -> list[list[int]]:
    """transformers' beam search on the served tiny model, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(server.config.model.path,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=num_beams, num_return_sequences=n,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, **settings)
    return [row[len(ids):].tolist() for row in out]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_beam_search_matches_transformers(server, client, tokenizer, stream):
    """``num_beams`` (with ``length_penalty`` / ``early_stopping``) or vLLM's
    ``use_beam_search`` on a decoder-only model: the ``n`` best hypotheses as choices, the
    ones transformers' ``generate`` returns, in completions and chat."""
    ids = tokenizer.encode(PROMPT)
    flags = {"ignore_eos": True, "return_token_ids": True}
    # (widths here where one beam more or less changes the answer)
    cases = (({"num_beams": 5, "length_penalty": 0.6, "early_stopping": True}, 3,
              {"length_penalty": 0.6, "early_stopping": True}, 5),
             ({"use_beam_search": True}, 2, {}, 2))
    for fields, n, settings, beams in cases:
        want = _generate_beams(server, ids, beams, n, 8, **settings)
        out = completion(client, n=n, max_tokens=8, stream=stream,
                         extra_body={**flags, **fields})
        got = {}
        for chunk in (out if stream else [out]):
            for c in chunk.choices:
                got.setdefault(c.index, []).extend(c.token_ids or [])
        assert [got[i] for i in range(n)] == want, fields
    messages = [{"role": "user", "content": "Hello"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=True)
    answer = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6,
                                            extra_body={**flags, "num_beams": 3})
    assert [c.token_ids for c in answer.choices] == _generate_beams(server, prompt, 3, 2, 6)
    with pytest.raises(openai.BadRequestError) as e:
        completion(client, logprobs=1, extra_body={"num_beams": 2})
    assert e.value.body["param"] == "logprobs"


def test_completion_streaming_matches_whole(client):
    whole = completion(client, logprobs=1)
    chunks = list(completion(client, logprobs=1, stream=True,
                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # several prompts and n > 1 interleave by index
    many = list(completion(client, prompt=[PROMPT, "def add"], n=2, stream=True,
                           temperature=1.0, seed=3))
    texts = {}
    for chunk in many:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2, 3]


def chat(client, **kw):
    args = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello"}],
            "temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}, **kw}
    return client.chat.completions.create(**args)


def test_chat_template_usage_and_content_parts(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "More"}]}]
    out = chat(client, messages=messages)
    expected = tokenizer.apply_chat_template(
        [{**m, "content": m["content"] if isinstance(m["content"], str) else "More"}
         for m in messages], tokenize=True)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(expected)
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    limited = chat(client, max_completion_tokens=5)
    assert limited.usage.completion_tokens == 5


def test_continue_final_message_continues_the_assistant_s_start(server, client, tokenizer):
    """The prompt ends inside the final message (the template's rendering checked against
    transformers' in tests/test_tokenizer.py), and the answer is that prompt's completion."""
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "The quick"}]
    out = chat(client, messages=messages, extra_body={
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                        continue_final_message=True)
    assert tokenizer.decode(ids).endswith("assistant: The quick")
    assert out.usage.prompt_tokens == len(ids)
    same = completion(client, prompt=ids)
    assert out.choices[0].message.content == same.choices[0].text
    status, _, raw = server.http("POST", "/tokenize", {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert status == 200 and json.loads(raw)["tokens"] == ids
    with pytest.raises(openai.BadRequestError) as both:
        chat(client, messages=messages, extra_body={"continue_final_message": True})
    assert both.value.body["param"] == "continue_final_message"
    # vLLM's echo: the answer starts with the final message's text, whole or streamed
    echo = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True}
    echoed = chat(client, messages=messages, extra_body=echo).choices[0].message.content
    assert echoed == "The quick" + out.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, messages=messages, stream=True, extra_body=echo) if c.choices)
    assert streamed == echoed
    plain = chat(client, extra_body={"ignore_eos": True, "echo": True})  # a user's: no echo
    assert plain.choices[0].message.content == chat(client).choices[0].message.content


def test_truncate_prompt_tokens_keeps_each_prompt_s_last_tokens(client, tokenizer):
    ids = [(5 * i) % 290 + 3 for i in range(600)]  # past the 512-token context
    cut = completion(client, prompt=ids, extra_body={"ignore_eos": True,
                                                     "truncate_prompt_tokens": 100})
    same = completion(client, prompt=ids[-100:])
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text == same.choices[0].text
    echoed = completion(client, prompt=PROMPT * 3, echo=True, max_tokens=2,
                        extra_body={"truncate_prompt_tokens": 4})
    kept = tokenizer.encode(PROMPT * 3)[-4:]
    assert echoed.usage.prompt_tokens == 4
    assert echoed.choices[0].text.startswith(tokenizer.decode(kept, skip_special_tokens=False))
    out = chat(client, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5,
                                   "return_prompt_text": True, "return_token_ids": True})
    assert out.usage.prompt_tokens == 5 == len(out.prompt_token_ids)
    assert out.prompt_text == tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as whole:
        completion(client, prompt=ids)
    assert whole.value.body["code"] == "context_length_exceeded"
    # vLLM's truncation_side "right" keeps the first tokens
    first = completion(client, prompt=ids, extra_body={
        "ignore_eos": True, "truncate_prompt_tokens": 100, "truncation_side": "right",
        "return_token_ids": True})
    assert first.choices[0].prompt_token_ids == ids[:100]
    assert first.choices[0].text == completion(client, prompt=ids[:100]).choices[0].text
    with pytest.raises(openai.BadRequestError) as alone:
        completion(client, extra_body={"truncation_side": "right"})
    assert alone.value.body["param"] == "truncation_side"


def test_chat_logprobs_n_stop_seed(client):
    out = chat(client, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content).startswith(out.choices[0].message.content[:1])
    sampled = dict(temperature=1.0, n=2, seed=11)
    a, b = chat(client, **sampled), chat(client, **sampled)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    text = chat(client).choices[0].message.content
    stopped = chat(client, stop=text[3:5]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == text[:text.index(text[3:5])]


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_structured_outputs_whole_and_streamed(client):
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(client, max_tokens=80, response_format=person, extra_body={}).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    chunks = chat(client, max_tokens=80, response_format=person, extra_body={}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.message.content)
    choices = ["left", "right", "up \"quoted\""]
    picked = completion(client, n=3, temperature=1.0, seed=2, max_tokens=20,
                        extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    regex = completion(client, max_tokens=20,
                       extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", regex.choices[0].text)


def test_chat_streaming_matches_whole(client):
    whole = chat(client, logprobs=True)
    chunks = list(chat(client, logprobs=True, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in whole.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create in (chat, completion):
        list(create(client, stream=True, stream_options=options))  # the prompt is cached
        chunks = list(create(client, stream=True, stream_options=options))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[0] < counts[-1] == 12
        # its cached tokens show from the first token on
        cached = [c.usage.prompt_tokens_details.cached_tokens for c in chunks if c.choices
                  and (c.choices[0].text if hasattr(c.choices[0], "text")
                       else c.choices[0].delta.content)]
        assert cached and set(cached) == {chunks[-1].usage.prompt_tokens_details.cached_tokens}
        assert cached[0] > 0
    # without include_usage it adds nothing, as in vLLM
    plain = list(chat(client, stream=True, stream_options={"include_usage": False,
                                                           "continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_tokenize_detokenize(server, tokenizer):
    status, _, body = server.http("POST", "/tokenize", {"model": "tiny", "prompt": PROMPT})
    tokens = json.loads(body)
    assert status == 200 and tokens["tokens"] == tokenizer.encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    messages = [{"role": "user", "content": "Hello"}]
    _, _, body = server.http("POST", "/tokenize", {"messages": messages})
    assert json.loads(body)["tokens"] == tokenizer.apply_chat_template(messages, tokenize=True)
    status, _, body = server.http("POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == PROMPT


def test_a_configured_chat_template_replaces_the_tokenizers(tmp_path):
    """``model.chat_template`` (vLLM's ``--chat-template``), a file or the text itself: chats
    and /tokenize render with it; the oracle is transformers given the same template. A
    model without a tokenizer cannot take one."""
    build_tiny("llama", tmp_path, std=0.15)
    template = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    (tmp_path / "override.jinja").write_text(template)
    oracle = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = oracle.apply_chat_template(messages, chat_template=template, tokenize=True,
                                          add_generation_prompt=True)["input_ids"]
    assert expected != oracle.apply_chat_template(messages, tokenize=True,
                                                  add_generation_prompt=True)["input_ids"]
    for value in (str(tmp_path / "override.jinja"), template):
        config = server_config(tmp_path, **{"server.served_model_name": "tiny",
                                            "model.chat_template": value})
        with ServerThread(config, Engine(config)) as s:
            _, _, body = s.http("POST", "/tokenize", {"messages": messages})
            assert json.loads(body)["tokens"] == expected
            reply = s.client().chat.completions.create(
                model="tiny", messages=messages, max_tokens=2,
                extra_body={"return_token_ids": True})
            assert reply.prompt_token_ids == expected
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(ValueError, match="model.chat_template needs the model's tokenizer"):
        Engine(server_config(tmp_path, **{"model.chat_template": template}))


def test_return_token_ids_gives_prompt_and_output_ids(client, tokenizer):
    """vLLM's ``return_token_ids``: the prompt's and the output's ids, whole and streamed
    (the prompt's in a choice's first chunk, then each chunk's new ids); absent unless asked
    for when the server has a tokenizer."""
    ids = dict(extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = completion(client, **ids).choices[0]
    assert whole.prompt_token_ids == tokenizer.encode(PROMPT)
    assert len(whole.token_ids) == 12 and tokenizer.decode(whole.token_ids) == whole.text
    chunks = [c.choices[0] for c in completion(client, stream=True, **ids)]
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert not any(c.model_extra.get("prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    echoed = [c.choices[0] for c in completion(client, stream=True, echo=True, **ids)]
    assert echoed[0].text == PROMPT and echoed[0].prompt_token_ids == whole.prompt_token_ids
    assert not any(c.model_extra.get("prompt_token_ids") for c in echoed[1:])
    assert [t for c in echoed for t in c.token_ids] == whole.token_ids
    assert "token_ids" not in completion(client).choices[0].model_extra
    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = dict(model="tiny", messages=messages, max_tokens=8, temperature=0.0, **ids)
    reply = client.chat.completions.create(**chat_ids)
    assert reply.prompt_token_ids == tokenizer.apply_chat_template(messages, tokenize=True)
    assert tokenizer.decode(reply.choices[0].token_ids) == reply.choices[0].message.content
    stream = list(client.chat.completions.create(stream=True, **chat_ids))
    assert stream[0].prompt_token_ids == reply.prompt_token_ids
    streamed = [t for c in stream if c.choices for t in c.choices[0].model_extra.get(
        "token_ids") or []]  # the first chunk (the role) has none
    assert streamed == reply.choices[0].token_ids


def test_without_a_tokenizer_outputs_are_token_ids(tmp_path):
    """A model directory with no tokenizer takes token ids and answers with them: its text
    is empty, so `return_token_ids` is on unless the request turns it off."""
    build_tiny("llama", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).unlink(missing_ok=True)
    config = server_config(tmp_path, **{"server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as server:
        assert server.async_engine.engine.tokenizer is None
        out = server.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                                 temperature=0.0, extra_body={"ignore_eos": True})
        choice = out.choices[0]
        assert choice.text == "" and choice.prompt_token_ids == [5, 6, 7]
        assert len(choice.token_ids) == 4 == out.usage.completion_tokens


def test_special_tokens_are_added_to_messages_only_when_asked(tmp_path):
    """As vLLM: a prompt gets the tokenizer's BOS unless ``add_special_tokens`` is false;
    messages, whose template writes its own, only when it is true; the same in /tokenize,
    completions and chat. Messages follow chat's rules (at least one; a user message needs
    content)."""
    build_tiny("llama", tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                "add_bos_token": True}))
    config = server_config(tmp_path, **{"server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as server:
        tokenizer = server.async_engine.engine.tokenizer
        bos = tokenizer.bos_token_id

        def tokens(**body):
            status, _, answer = server.http("POST", "/tokenize", body)
            assert status == 200, answer
            return json.loads(answer)["tokens"]

        assert tokens(prompt="Hello")[0] == bos != tokens(prompt="Hello",
                                                           add_special_tokens=False)[0]
        messages = [{"role": "user", "content": "Hello"}]
        plain = tokens(messages=messages)
        assert plain == tokenizer.apply_chat_template(messages, tokenize=True)
        assert tokens(messages=messages, add_special_tokens=True) == [bos, *plain]
        for body, param in (({"messages": []}, "messages"),
                            ({"messages": [{"role": "user"}]}, "messages[0].content")):
            status, _, answer = server.http("POST", "/tokenize", body)
            assert status == 400 and json.loads(answer)["error"]["param"] == param, answer
        client = server.client()
        for special in (True, False):
            flag = {"return_token_ids": True, "add_special_tokens": special}
            cmpl = client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                             extra_body=flag).choices[0]
            assert cmpl.prompt_token_ids == tokens(prompt="Hello", add_special_tokens=special)
            answer = client.chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=1, extra_body=flag)
            assert answer.prompt_token_ids == tokens(messages=messages,
                                                     add_special_tokens=special)


def test_request_id_is_echoed_and_logged(server, client):
    with structlog.testing.capture_logs() as logs:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=PROMPT, max_tokens=3, extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    # (a stream of an earlier test may log its line after its client has read [DONE])
    (line,) = [e for e in logs if e["event"] == "request" and e["request_id"] == "abc-123"]
    assert line["model"] == "tiny"
    assert line["prompt_tokens"] == raw.parse().usage.prompt_tokens
    assert line["completion_tokens"] == raw.parse().usage.completion_tokens
    assert {"cached_tokens", "ttft_s", "duration_s", "finish_reason"} <= set(line)
    status, headers, _ = server.http("GET", "/health")
    assert headers["X-Request-Id"]  # made up when the client sent none


def test_metrics_count_tokens_and_return_to_idle(server, client):
    before = server.metrics()
    out = completion(client, max_tokens=5)
    after = server.wait_for(lambda m: m["heron_requests_running"] == 0)
    assert after["heron_generation_tokens_total"] - before["heron_generation_tokens_total"] == 5
    assert (after["heron_prompt_tokens_total"] - before["heron_prompt_tokens_total"]
            == out.usage.prompt_tokens)
    assert after["heron_kv_blocks_in_use"] == 0 and after["heron_requests_waiting"] == 0
    assert after["heron_kv_blocks_total"] == 256
    assert after["heron_host_kv_blocks_in_use"] == after["heron_state_snapshots"] == 0
    delta = {k: after[k] - before.get(k, 0) for k in ("heron_prefix_cache_hit_tokens_total",
                                                      "heron_prefix_cache_queried_tokens_total")}
    assert delta["heron_prefix_cache_queried_tokens_total"] == out.usage.prompt_tokens
    assert (delta["heron_prefix_cache_hit_tokens_total"]
            == out.usage.prompt_tokens_details.cached_tokens)
    for name in ("heron_time_to_first_token_seconds", "heron_inter_token_latency_seconds",
                 "heron_e2e_request_latency_seconds"):
        assert after[f"{name}_count"] > before.get(f"{name}_count", 0)
