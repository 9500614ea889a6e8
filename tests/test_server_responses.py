"""/v1/responses through the openai client (`client.responses`), on the tiny reasoning model
of `tests.test_server_reasoning`. Oracles: transformers' `apply_chat_template` for what
the input items render to and its greedy tokens for the output, `jsonschema` for answers
held to a schema; the stream's events must add up to the whole response."""

from __future__ import annotations

import json

import jsonschema
import pytest

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.test_server_reasoning import (  # noqa: F401 (fixtures)
    ANSWER, ASK, OPEN, TOOL, model_dir, oracle)

MAX_TOKENS = 40
TOOLS = [{"type": "function", **TOOL["function"]}]  # the Responses API's flat shape


def serve(model_dir, **settings):
    config = server_config(model_dir, **{"server.served_model_name": "tiny", **settings})
    return ServerThread(config, Engine(config))


@pytest.fixture(scope="module")
def plain(model_dir):
    with serve(model_dir, **{"server.tool_call_parser": "hermes"}) as server:
        yield server


@pytest.fixture(scope="module")
def r1(model_dir):
    with serve(model_dir, **{"server.reasoning_parser": "deepseek_r1"}) as server:
        yield server


def respond(server, **kw):
    args = {"model": "tiny", "input": "What is 2 + 2?", "temperature": 0.0,
            "max_output_tokens": MAX_TOKENS, **kw}
    return server.client().responses.create(**args)


def biased(oracle, kwargs=None) -> dict:
    """The request fields under which the model ends its thinking a few tokens in."""
    body = {"logit_bias": {str(oracle.end): oracle.bias}}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return {"extra_body": body}


def replay(events) -> tuple[list[str], dict, object]:
    """The event types in order, each item's text rebuilt from its deltas, and the last
    event's response; checks the numbering and the item bookkeeping on the way."""
    types, texts, final, open_items = [], {}, None, {}
    for number, event in enumerate(events):
        assert event.sequence_number == number
        types.append(event.type)
        if event.type == "response.output_item.added":
            open_items[event.output_index] = event.item.id
            texts[event.item.id] = ""
        elif event.type.endswith(".delta"):
            assert open_items[event.output_index] == event.item_id
            texts[event.item_id] += event.delta
        elif event.type == "response.output_item.done":
            assert open_items.pop(event.output_index) == event.item.id
        final = event
    assert not open_items and final.type in ("response.completed", "response.incomplete")
    return types, texts, final.response


def test_text_answer_whole_and_streamed(plain, oracle):
    prompt = oracle.prompt([{"role": "system", "content": "Be brief."}, *ASK])
    text = oracle.tokenizer.decode(oracle.greedy(prompt, 0.0), skip_special_tokens=True)
    out = respond(plain, instructions="Be brief.")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == text and len(out.output) == 1
    assert out.usage.input_tokens == len(prompt) and out.usage.output_tokens == MAX_TOKENS
    assert out.usage.total_tokens == len(prompt) + MAX_TOKENS
    assert out.output[0].status == "incomplete" and out.store is False
    types, texts, final = replay(respond(plain, instructions="Be brief.", stream=True))
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert list(texts.values()) == [text] and final.output_text == text
    cached = {"input_tokens_details"}  # the second request hits the prefix cache
    assert final.usage.model_dump(exclude=cached) == out.usage.model_dump(exclude=cached)
    stop = text[4:8]
    short = respond(plain, instructions="Be brief.", extra_body={"stop": [stop]})
    assert short.status == "completed" and short.incomplete_details is None
    assert short.output_text == text[:text.index(stop)]


def test_input_items_render_as_the_chat_they_stand_for(plain, oracle):
    """Messages, two calls of one turn and their outputs, and earlier thinking: the prompt
    is what transformers renders of the equivalent chat."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Add 2 and 2."}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should call add."}]},
             {"type": "function_call", "call_id": "call_1", "name": "add",
              "arguments": '{"a": 2, "b": 2}'},
             {"type": "function_call", "call_id": "call_2", "name": "add",
              "arguments": '{"a": 1, "b": 3}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "4"},
             {"type": "function_call_output", "call_id": "call_2",
              "output": [{"type": "input_text", "text": "4"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "It is 4."}]},
             {"role": "user", "content": "Thanks"}]
    chat = [{"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Add 2 and 2."},
            {"role": "assistant", "content": "", "reasoning_content": "I should call add.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "add", "arguments": {"a": 2, "b": 2}}},
                            {"id": "call_2", "type": "function",
                             "function": {"name": "add", "arguments": {"a": 1, "b": 3}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            {"role": "tool", "tool_call_id": "call_2", "content": "4"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "Thanks"}]
    prompt = oracle.prompt(chat, tools=[TOOL])
    out = respond(plain, instructions="Use tools.", input=items, tools=TOOLS,
                  tool_choice="none", max_output_tokens=1)
    assert out.usage.input_tokens == len(oracle.prompt(chat)) != len(prompt)  # "none": no tools
    out = respond(plain, instructions="Use tools.", input=items, tools=TOOLS,
                  max_output_tokens=1)
    assert out.usage.input_tokens == len(prompt)


def test_thinking_comes_as_a_reasoning_item(r1, oracle):
    tokens = oracle.greedy(oracle.prompt(ASK, OPEN), oracle.bias)
    reasoning, _, content = oracle.tokenizer.decode(
        tokens, skip_special_tokens=True).partition("</think>")
    out = respond(r1, **biased(oracle, OPEN))
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == reasoning and out.output_text == content
    assert out.usage.output_tokens_details.reasoning_tokens == tokens.index(oracle.end) + 1
    types, texts, final = replay(respond(r1, stream=True, **biased(oracle, OPEN)))
    assert list(texts.values()) == [reasoning, content]
    assert "response.reasoning_text.done" in types
    assert types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in out.output]


def test_text_format_holds_the_answer_after_the_thinking(r1, oracle):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
    out = respond(r1, text=fmt, max_output_tokens=200, **biased(oracle, OPEN))
    reasoning = oracle.text(oracle.prompt(ASK, OPEN)).partition("</think>")[0]
    assert out.status == "completed" and out.output[0].content[0].text == reasoning
    jsonschema.validate(json.loads(out.output_text), ANSWER)
    assert out.text.format.type == "json_schema"


def test_function_calls_whole_and_streamed(plain):
    named = {"type": "function", "name": "add"}
    out = respond(plain, tools=TOOLS, tool_choice=named, max_output_tokens=200)
    [call] = out.output
    assert call.type == "function_call" and call.name == "add" and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
    types, texts, final = replay(respond(plain, tools=TOOLS, tool_choice=named,
                                         max_output_tokens=200, stream=True))
    assert types.count("response.function_call_arguments.delta") > 2  # as they come
    [done] = [i for i in final.output if i.type == "function_call"]
    assert texts[done.id] == done.arguments == call.arguments
    out = respond(plain, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_output_tokens=200)
    assert [item.type for item in out.output] == ["function_call"]
    jsonschema.validate(json.loads(out.output[0].arguments), TOOL["function"]["parameters"])
    types, texts, final = replay(respond(plain, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=200,
                                         stream=True))
    assert final.output[0].arguments == out.output[0].arguments
    # "auto": this model writes no call, so its text is the message, streamed as it comes
    out = respond(plain, tools=TOOLS)
    assert [item.type for item in out.output] == ["message"] and out.output_text
    types, texts, final = replay(respond(plain, tools=TOOLS, stream=True))
    assert types.count("response.output_text.delta") > 1
    assert list(texts.values()) == [out.output_text] == [final.output_text]


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": ["hi", {"type": "function_call", "name": "add"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "add"}]},
     "input[1]"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
])
def test_bad_requests_name_the_field(plain, body, param):
    status, _, raw = plain.http("POST", "/v1/responses",
                                {"model": "tiny", "input": "hi", **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error


def test_an_answer_goes_back_as_input_the_way_agents_loop(r1, oracle):
    """The output items of one response, sent back as they came with the call's output:
    the next prompt is what transformers renders of that conversation."""
    named = {"type": "function", "name": "add"}
    first = respond(r1, tools=TOOLS, tool_choice=named, max_output_tokens=200,
                    **biased(oracle, OPEN))
    thought, call = first.output
    assert (thought.type, call.type) == ("reasoning", "function_call")
    items = [{"role": "user", "content": "What is 2 + 2?"}, *first.output,
             {"type": "function_call_output", "call_id": call.call_id, "output": "4"}]
    out = respond(r1, input=items, tools=TOOLS, tool_choice=named, max_output_tokens=1,
                  extra_body={"chat_template_kwargs": OPEN})
    chat = [*ASK, {"role": "assistant", "content": "",
                   "reasoning_content": thought.content[0].text,
                   "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                       "name": "add", "arguments": json.loads(call.arguments)}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "4"}]
    assert out.usage.input_tokens == len(oracle.prompt(chat, OPEN, tools=[TOOL]))
