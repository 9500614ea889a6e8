"""Anthropic's Messages API through the official `anthropic` client, on the tiny model whose
chat template renders tools and earlier calls. Oracles: the same conversation through
/v1/chat/completions (the openai client) for the text, transformers' `apply_chat_template`
for the prompt, `jsonschema` for the calls' inputs."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.test_server_tools import SCHEMAS, TOOLS, build_tool_model

KEY = "sk-anthropic-test"
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                    **({"description": t["function"]["description"]}
                       if "description" in t["function"] else {})} for t in TOOLS]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# an earlier call and its result, in each API's shape
HISTORY = ASK + [
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "unit": "c"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"},
        {"type": "text", "text": "And tomorrow?"}]}]
CHAT_HISTORY = ASK + [
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "21"},
    {"role": "user", "content": "And tomorrow?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tiny-tools"))


@pytest.fixture(scope="module")
def server(model_dir):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "server.tool_call_parser": "hermes",
                                         "server.api_keys": [KEY]})
    with ServerThread(config, Engine(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


GREEDY = {"extra_body": {"temperature": 0.0}}  # newer clients take no sampling arguments


def create(client, **kw):
    return client.messages.create(**{"model": "tiny", "max_tokens": 12, "messages": ASK,
                                     **GREEDY, **kw})


def test_text_matches_chat_whole_and_streamed(server, client):
    chat = server.client(api_key=KEY).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=12, temperature=0.0)
    out = create(client, system="Be brief.")
    assert out.type == "message" and out.role == "assistant" and out.model == "tiny"
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == chat.choices[0].message.content
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.usage.output_tokens == 12
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model="tiny", max_tokens=12, messages=ASK, system="Be brief.",
                                **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert kinds.count("content_block_delta") > 1  # the text as it comes
    assert final.content[0].text == out.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_a_final_assistant_message_is_continued(server, client):
    """Anthropic's prefill: the answer continues the final assistant message (chat's
    ``continue_final_message``), and count_tokens counts that prompt."""
    messages = ASK + [{"role": "assistant", "content": "It is"}]
    chat = server.client(api_key=KEY).chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0.0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    out = create(client, messages=messages)
    assert out.content[0].text == chat.choices[0].message.content
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model="tiny", messages=messages)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stop_sequences_name_the_one_met(client):
    text = create(client).content[0].text
    stop = text[3:6]
    out = create(client, stop_sequences=["zzzz", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]


def test_a_thinking_budget_without_a_reasoning_parser_is_accepted(client):
    """Clients send ``budget_tokens`` with every ``thinking``; a server that cannot tell the
    thinking apart (no reasoning parser) answers as without it (this template ignores
    ``enable_thinking``)."""
    out = create(client, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == create(client).content[0].text


def test_output_config_format_holds_the_answer_to_a_schema(client):
    out = create(client, max_tokens=60, output_config={
        "format": {"type": "json_schema", "schema": SCHEMAS["get_time"]}})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), SCHEMAS["get_time"])


def test_history_renders_as_chat_does(server, client, model_dir):
    """System text, earlier calls and their results reach the template as chat's messages
    would: count_tokens and the answer's usage agree with transformers' rendering."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    plain = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in CHAT_HISTORY]
    want = tokenizer.apply_chat_template(plain, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    counted = client.messages.count_tokens(model="tiny", messages=HISTORY,
                                           tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == len(want)
    out = create(client, messages=HISTORY, tools=ANTHROPIC_TOOLS)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(want)
    chat = server.client(api_key=KEY).chat.completions.create(
        model="tiny", messages=CHAT_HISTORY, tools=TOOLS, max_tokens=12, temperature=0.0)
    assert [b.text for b in out.content if b.type == "text"] == [chat.choices[0].message.content]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_gives_tool_use_blocks(client, stream):
    def run(**kw):
        if not stream:
            return create(client, tools=ANTHROPIC_TOOLS, max_tokens=80, **kw)
        with client.messages.stream(model="tiny", messages=ASK, max_tokens=80,
                                    tools=ANTHROPIC_TOOLS, **GREEDY, **kw) as events:
            received = list(events)
            final = events.get_final_message()
        kinds = [event.type for event in received]
        # every block opens and closes: a call's input is whole at its stop
        assert kinds.count("content_block_start") == kinds.count("content_block_stop")
        assert kinds.count("content_block_stop") == len(final.content)
        pieces.extend(e.delta.partial_json for e in received
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        return final

    pieces = []
    named = run(tool_choice={"type": "tool", "name": "get_time"})
    (call,) = named.content
    assert named.stop_reason == "tool_use" and call.type == "tool_use"
    assert call.name == "get_time" and call.id
    jsonschema.validate(call.input, SCHEMAS["get_time"])
    if stream:  # a named call's input comes as the model writes it, in pieces
        assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input
    forced = run(tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (call,) = forced.content
    assert forced.stop_reason == "tool_use" and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    none = run(tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"] and none.stop_reason == "max_tokens"


def test_errors_come_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, messages=[{"role": "user", "content": [image]}])
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, stop_sequences=["x" * 5000])
    assert e.value.body["error"]["message"].startswith("`stop_sequences[0]` is 5000")
    for choice in ({"type": "tool"}, {"type": "tool", "name": "nope"}):
        for call in (create, client.messages.count_tokens):
            with pytest.raises(anthropic.BadRequestError) as e:
                call(**({"client": client} if call is create else {}), model="tiny",
                     messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice)
            assert "tool_choice.name" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="claude-sonnet-4")
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert server.async_engine.engine.num_blocks_in_use == 0


def test_openapi_lists_the_messages_routes(server):
    doc = json.loads(server.http("GET", "/openapi.json")[2])
    route = doc["paths"]["/v1/messages"]["post"]
    assert route["responses"]["default"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"}
    assert {"max_tokens", "messages", "system", "tools", "stop_sequences"} <= set(
        doc["components"]["schemas"]["MessagesRequest"]["properties"])
    assert "/v1/messages/count_tokens" in doc["paths"]
