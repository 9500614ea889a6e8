"""The default real model (SmolLM2-135M-Instruct) behind the server and the openai client.

The config names no model, so this also shows that the server falls back to the default
model exactly as `heron serve` without MODEL does.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from heron.core.config import load_config
from tests.server_utils import CONF, ServerThread

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_gguf_path):  # fetched once by the fixture; the app finds it by itself
    config = load_config(CONF / "test.toml", {"model.max_model_len": 2048,
                                              "engine.max_num_batched_tokens": 256})
    assert config.model.path is None
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_serves_the_default_model(client):
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_answers_paris_with_exact_usage(server, client):
    tokenizer = server.async_engine.engine.tokenizer
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION,
                                         temperature=0.0, max_tokens=32, logprobs=True)
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(tokenizer.apply_chat_template(QUESTION, tokenize=True))
    # every generated token (the end-of-turn token included) has its logprob entry
    assert out.usage.completion_tokens == len(choice.logprobs.content)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_greedy_streaming_equals_whole_for_chat_and_completions(client):
    args = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION + [
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Name three rivers of France."}],
                temperature=0.0, max_tokens=24)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    usage = chunks[-1].usage
    assert ((usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
            == (whole.usage.prompt_tokens, whole.usage.completion_tokens,
                whole.usage.total_tokens))
    # the second call reuses the first one's prompt and answer blocks
    assert (usage.prompt_tokens_details.cached_tokens
            > whole.usage.prompt_tokens_details.cached_tokens)
    prompt = dict(model=args["model"], prompt="The Eiffel Tower is in", temperature=0.0,
                  max_tokens=12)
    whole = client.completions.create(**prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **prompt))
    assert streamed == whole.choices[0].text and "Paris" in streamed


def test_text_offsets_of_characters_split_over_tokens(client):
    """An emoji and CJK characters take several byte-level tokens each. Every token's
    ``text_offset`` points into the returned text (pieces of a character, held back until
    it is whole, share the offset of the text they complete), echoed prompt and generated
    tokens alike, streamed or not."""
    prompt = ("<|im_start|>user\nRepeat: 🎉 你好<|im_end|>\n<|im_start|>assistant\n"
              "Sure: 🎉 你")
    args = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, temperature=0.0,
                max_tokens=12, logprobs=0, echo=True)
    whole = client.completions.create(**args).choices[0]
    lp, text = whole.logprobs, whole.text
    split = [t for t in lp.tokens if "\ufffd" in t]
    assert len(split) >= 6 and text.startswith(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for i, (token, offset) in enumerate(zip(lp.tokens, lp.text_offset)):
        whole = token.split("\ufffd")[0]  # then pieces of a character
        assert text[offset:offset + len(whole)] == whole, (i, token, offset)
        if not whole:  # only pieces: of the character at (or, held back with it, after)
            assert any(len(c.encode()) > 1 for c in text[offset:offset + 2]), (i, offset)
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprob_bytes_join_into_the_content(client):
    """A token holding part of a character shows U+FFFD as its ``token`` but its own
    ``bytes``: joined, they are the content's UTF-8, streamed or not (OpenAI's contract)."""
    args = dict(model="SmolLM2-135M-Instruct.Q4_1", temperature=0.0, max_tokens=12,
                logprobs=True, top_logprobs=2,
                messages=[{"role": "user", "content": "Repeat exactly: 🎉 你好"}])
    whole = client.chat.completions.create(**args).choices[0]
    entries = whole.logprobs.content
    if whole.finish_reason == "stop":  # the end-of-turn token: not in the content
        entries = entries[:-1]
    assert sum("\ufffd" in e.token for e in entries) >= 3
    assert bytes(b for e in entries for b in e.bytes) == whole.message.content.encode()
    assert all(t.bytes and bytes(t.bytes).decode("utf-8", "replace") == t.token
               or "\ufffd" in t.token for e in entries for t in e.top_logprobs)
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.bytes for e in streamed[:len(entries)]] == [e.bytes for e in entries]


CITY = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}}


def test_json_schema_and_json_object_answers(client):
    """The real model under a grammar: a JSON answer that the schema accepts, with the
    capital right."""
    ask = QUESTION[0]["content"] + " Answer in JSON."
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": ask}],
        temperature=0.0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    choice = out.choices[0]
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, CITY)
    assert choice.finish_reason == "stop" and "Paris" in answer["capital"]
    free = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": ask}],
        temperature=0.0, max_tokens=64, response_format={"type": "json_object"}).choices[0]
    assert free.finish_reason == "stop" and isinstance(json.loads(free.message.content), dict)


def test_named_tool_call(client):
    """A template without tools still gets calls whose arguments match the schema."""
    tool = {"type": "function", "function": {"name": "lookup_capital", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["country"],
        "properties": {"country": {"type": "string"}}}}}
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, temperature=0.0, max_tokens=32,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "lookup_capital"}})
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert choice.finish_reason == "tool_calls" and call.function.name == "lookup_capital"
    assert arguments["country"].lower() == "france"


def test_responses_api_answers_as_chat_does(client):
    """The same question through /v1/responses: the answer and its usage are chat's."""
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                          messages=QUESTION, temperature=0.0, max_tokens=32)
    out = client.responses.create(model="SmolLM2-135M-Instruct.Q4_1",
                                  input="What is the capital of France?", temperature=0.0,
                                  max_output_tokens=32)
    assert out.status == "completed" and "Paris" in out.output_text
    assert out.output_text == chat.choices[0].message.content
    assert (out.usage.input_tokens, out.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
