"""Tool calling through the openai client, on a tiny model whose chat template renders tools
and earlier calls (Qwen's conventions). Oracles: transformers' `apply_chat_template` for
the prompt, `jsonschema` for the calls' arguments."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from heron.core.engine import Engine
from heron.server.tools import CallHold, ToolPlan
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

TEMPLATE = (
    "{%- if tools %}<s>system: tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}<s>assistant:"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["c", "f"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tools")
    build_tiny("llama", path, std=0.15, max_position_embeddings=2048)  # tools' JSON is long
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "server.tool_call_parser": "hermes"})
    with ServerThread(config, Engine(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kw):
    args = {"model": "tiny", "messages": ASK, "temperature": 0.0, "max_tokens": 60,
            "tools": TOOLS, **kw}
    return client.chat.completions.create(**args)


def oracle_prompt(model_dir, messages, tools) -> list[int]:
    """transformers' rendering; earlier calls' arguments as objects, as templates take them."""
    plain = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(plain, tools=tools, tokenize=True,
                                         add_generation_prompt=True)["input_ids"]


def oracle_prompt_tokens(model_dir, messages, tools) -> int:
    return len(oracle_prompt(model_dir, messages, tools))


def assert_valid(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_whole_and_streamed(client, model_dir):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tool_choice=named, messages=HISTORY)
    assert out.usage.prompt_tokens == oracle_prompt_tokens(model_dir, HISTORY, TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid(call)
    chunks = list(chat(client, tool_choice=named, messages=HISTORY, stream=True))
    pieces = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(pieces) > 2  # the arguments stream as they come
    assert (pieces[0].function.name, pieces[0].type) == ("get_weather", "function")
    assert pieces[0].id and all(p.id is None and p.function.name is None for p in pieces[1:])
    assert {p.index for p in pieces} == {0}
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_required_streams_its_calls_whole(client):
    one = dict(tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    whole = chat(client, **one).choices[0]
    chunks = list(chat(client, stream=True, **one))
    [call] = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    [expected] = whole.message.tool_calls
    assert (call.index, call.function.name, call.function.arguments) == (
        0, expected.function.name, expected.function.arguments)
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_required_gives_calls_of_the_tools(client):
    out = chat(client, tool_choice="required", n=4, temperature=1.0, seed=4, max_tokens=120,
               parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert_valid(call)
    assert {c.message.tool_calls[0].function.name for c in out.choices} == set(SCHEMAS)


def test_auto_and_none(client, model_dir):
    """This random model writes no <tool_call>: "auto" answers in text, with the tools in
    the prompt; "none" leaves them out of it."""
    auto = chat(client, max_tokens=12)
    assert auto.usage.prompt_tokens == oracle_prompt_tokens(model_dir, ASK, TOOLS)
    assert auto.choices[0].message.tool_calls == [] and auto.choices[0].message.content
    assert auto.choices[0].finish_reason in ("stop", "length")
    pieces = [c.choices[0].delta.content for c in chat(client, max_tokens=12, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == auto.choices[0].message.content  # as it comes
    none = chat(client, tool_choice="none", max_tokens=12)
    assert none.usage.prompt_tokens == oracle_prompt_tokens(model_dir, ASK, None)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, tool_choice="none", max_tokens=12, stream=True) if c.choices)
    assert streamed == none.choices[0].message.content


HERMES_TEXTS = [
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>',
    'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Nice", '
    '"unit": "c"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}'
    '</tool_call>',
    "It is sunny.  \n",
    "A <tool is no call <tool_cal",
    ' \n<tool_call>{"name": "get_time", "arguments": {"zone": ',  # cut short
]


def test_tokenize_renders_tools_as_chat_does(server, client, model_dir):
    """vLLM's /tokenize takes a chat request's ``tools`` and ``chat_template_kwargs``: the
    ids are the prompt the chat request gets; ``return_token_strs`` adds the vocabulary's
    strings."""
    status, _, raw = server.http("POST", "/tokenize", {
        "model": "tiny", "messages": HISTORY, "tools": TOOLS, "return_token_strs": True,
        "chat_template_kwargs": {"unused_flag": True}})
    out = json.loads(raw)
    assert status == 200 and out["tokens"] == oracle_prompt(model_dir, HISTORY, TOOLS)
    assert out["count"] == chat(client, messages=HISTORY, max_tokens=1).usage.prompt_tokens
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    plain = json.loads(server.http("POST", "/tokenize", {"messages": HISTORY})[2])
    assert plain["tokens"] == oracle_prompt(model_dir, HISTORY, None) and "token_strs" not in plain
    for body, param in (({"messages": ASK, "chat_template_kwargs": {"tools": []},
                          "tools": TOOLS}, "chat_template_kwargs"),
                        ({"prompt": "hi", "tools": TOOLS}, "tools"),
                        ({"messages": ASK, "tools": TOOLS + TOOLS[:1]}, "tools")):
        status, _, raw = server.http("POST", "/tokenize", body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_auto_streams_the_content_that_the_whole_answer_has():
    """Any split of the text into pieces: the content sent is the parser's, or the whole
    text when no call parses, and the calls come at the end."""
    rng = random.Random(0)
    plan = ToolPlan("auto", TOOLS)
    for text in HERMES_TEXTS:
        content, calls = plan.parse(text)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 8)))
            hold, sent = CallHold(), ""
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                sent += hold.feed(text[a:b])
            rest, got = hold.end(plan)
            assert sent + rest == ((content or "") if calls else text), (text, cuts)
            assert [(c.function.name, c.function.arguments) for c in got] == [
                (c.function.name, c.function.arguments) for c in calls]
    hold = CallHold()
    assert hold.feed("Let me check.\n<tool") == "Let me check."
    assert hold.feed("_call>{") == "" and hold.feed("}") == ""


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>', None,
     [("get_time", {"zone": 2})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Nice", '
     '"unit": "c"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}'
     '</tool_call>', "Let me check.",
     [("get_weather", {"city": "Nice", "unit": "c"}), ("get_time", {"zone": 1})]),
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": ', None, []),  # cut short
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
])
def test_hermes_parser(text, content, calls):
    got_content, got = ToolPlan("auto", TOOLS).parse(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)


def test_required_parses_every_call_and_keeps_a_cut_one_as_text():
    plan = ToolPlan("required", TOOLS)
    text = ('[{"name":"get_time","parameters":{"zone":3}},'
            '{"name":"get_weather","parameters":{"city":"Oslo","unit":"f"}}]')
    content, calls = plan.parse(text)
    assert content is None and [(c.function.name, json.loads(c.function.arguments))
                                for c in calls] == [("get_time", {"zone": 3}),
                                                    ("get_weather", {"city": "Oslo", "unit": "f"})]
    assert plan.parse(text[:30]) == (text[:30], [])
    named = ToolPlan("named", TOOLS, "get_time")
    for text in ('{"zone":5}', '{"zone":'):  # a named call is the text, cut short or not
        content, [call] = named.parse(text)
        assert content is None and call.function.arguments == text
