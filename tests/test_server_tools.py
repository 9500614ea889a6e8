"""Tool calling through the openai client, on a tiny model whose chat template renders tools
and earlier calls (Qwen's conventions). Oracles: transformers' `apply_chat_template` for
the prompt, `jsonschema` for the calls' arguments."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from heron.core.engine import Engine
from heron.core.config import TOOL_CALL_PARSERS
from heron.server.tool_parsers import FORMATS
from heron.server.tools import CallHold, ToolPlan
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

TEMPLATE = (
    "{%- if tools %}<s>system: tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "{% endif %}"
    "{%- if documents %}<s>system: documents:{% for d in documents %}\n{{ d.title }}: "
    "{{ d.text }}{% endfor %}\n{% endif %}"
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


def build_tool_model(path):
    """The tiny model with `TEMPLATE`, which renders tools, calls and documents."""
    build_tiny("llama", path, std=0.15, max_position_embeddings=2048)  # tools' JSON is long
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tiny-tools"))


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


def test_documents_reach_the_template_and_the_prompt_text_comes_back(client, model_dir):
    """vLLM's ``documents`` (RAG templates) and ``return_prompt_text`` (the rendered
    prompt, whole or in a stream's first chunk), against transformers' rendering."""
    docs = [{"title": "Paris", "text": "Sunny, 21 C."}, {"title": "Nice", "text": "Rain."}]
    want = PreTrainedTokenizerFast.from_pretrained(model_dir).apply_chat_template(
        ASK, documents=docs, add_generation_prompt=True, tokenize=False)
    assert "Sunny, 21 C." in want
    fields = {"documents": docs, "return_prompt_text": True}
    out = chat(client, tool_choice="none", max_tokens=2, extra_body=fields)
    assert out.prompt_text == want
    first = next(iter(chat(client, tool_choice="none", max_tokens=2, stream=True,
                           extra_body=fields)))
    assert first.prompt_text == want
    assert chat(client, max_tokens=1).model_extra.get("prompt_text") is None
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=1, extra_body={"documents": docs,
                                               "chat_template_kwargs": {"documents": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_other_parsers_serve_auto(model_dir, parser):
    """A server with another parser answers "auto" the same way, whole and streamed (this
    random model's text holds no call)."""
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "server.tool_call_parser": parser})
    with ServerThread(config, Engine(config)) as server:
        client = server.client()
        auto = chat(client, max_tokens=12).choices[0]
        assert auto.message.tool_calls == [] and auto.message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(
            client, max_tokens=12, stream=True) if c.choices)
        assert streamed == auto.message.content


def test_mistral_markers_stay_in_the_text(tmp_path):
    """Mistral's markers are special tokens: with its parser the text keeps them (here
    ``[TOOL_CALLS]`` forced at every step, with no call after it: content as it is)."""
    build_tool_model(tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.save_pretrained(tmp_path)
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker < 320  # inside the model's vocabulary
    for parser, content in (("mistral", "[TOOL_CALLS]" * 3), ("hermes", "")):
        config = server_config(tmp_path, **{"server.served_model_name": "tiny",
                                             "server.tool_call_parser": parser})
        with ServerThread(config, Engine(config)) as server:
            out = chat(server.client(), max_tokens=3, logit_bias={str(marker): 100},
                       extra_body={"ignore_eos": True}).choices[0]
            assert out.message.tool_calls == [] and (out.message.content or "") == content
            plain = chat(server.client(), max_tokens=3, logit_bias={str(marker): 100},
                         tool_choice="none", extra_body={"ignore_eos": True}).choices[0]
            assert not plain.message.content  # without "auto" special tokens go as ever


# answers as each format writes them: calls, content, cut-short and slipped calls
TEXTS = {
    "hermes": [
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>',
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Nice", '
        '"unit": "c"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}'
        '</tool_call>',
        "It is sunny.  \n",
        "A <tool is no call <tool_cal",
        ' \n<tool_call>{"name": "get_time", "arguments": {"zone": ',  # cut short
    ],
    "llama3_json": [
        '{"name": "get_time", "parameters": {"zone": 2}}',
        ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice", "unit": "c"}}; '
        '{"name": "get_time", "arguments": {"zone": 1}}',
        "It is {sunny}.",
        '  <|python_ta',
        '{"name": "get_time", "parameters": {"zone": 2}} and more',  # not only calls
        '{"name": "get_time", "parameters": {"zo',  # cut short
    ],
    "pythonic": [
        '[get_time(zone=2)]',
        ' [get_weather(city="Nice", unit="c"), get_time(zone=1)]\n',
        "It is [sunny].",
        "[1, 2, 3]",
        '[get_weather("Nice")]',  # arguments must be named
        '[get_weather(city="Ni',  # cut short
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 2}}]',
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "unit": "c"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": 1}',
        "It is sunny [TOOL",
        '[TOOL_CALLS]get_time[ARGS]{"zone": ',  # cut short
        "[TOOL_CALLS][TOOL_CALLS]",
    ],
}


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


def test_every_parser_is_a_config_choice():
    assert set(FORMATS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_auto_streams_the_content_that_the_whole_answer_has(parser):
    """Any split of the text into pieces: the content sent is the parser's, or the whole
    text when no call parses, and the calls come at the end."""
    rng = random.Random(0)
    form = FORMATS[parser]
    plan = ToolPlan("auto", TOOLS, form=form)
    for text in TEXTS[parser]:
        content, calls = plan.parse(text)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 8)))
            hold, sent = CallHold(form), ""
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                sent += hold.feed(text[a:b])
            rest, got = hold.end(plan)
            assert sent + rest == ((content or "") if calls else text), (text, cuts)
            assert [(c.function.name, c.function.arguments) for c in got] == [
                (c.function.name, c.function.arguments) for c in calls]


def test_content_goes_out_before_the_calls_are_known():
    hold = CallHold(FORMATS["hermes"])
    assert hold.feed("Let me check.\n<tool") == "Let me check."
    assert hold.feed("_call>{") == "" and hold.feed("}") == ""
    for parser, opener in (("llama3_json", "{"), ("pythonic", "[")):
        hold = CallHold(FORMATS[parser])  # calls are the whole answer: decided at its start
        assert hold.feed("  ") == "" and hold.feed(opener + "x") == "" and hold.feed("y") == ""
        hold = CallHold(FORMATS[parser])
        assert hold.feed(" <|py") == "" and hold.feed("thon is") == " <|python is"
        assert hold.feed(" " + opener) == " " + opener


ZONE_2, NICE_1 = [("get_time", {"zone": 2})], [("get_weather", {"city": "Nice", "unit": "c"}),
                                               ("get_time", {"zone": 1})]


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", TEXTS["hermes"][0], None, ZONE_2),
    ("hermes", TEXTS["hermes"][1], "Let me check.", NICE_1),
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("hermes", TEXTS["hermes"][4], None, []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
    ("hermes", '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>', None, []),
    ("llama3_json", TEXTS["llama3_json"][0], None, ZONE_2),
    ("llama3_json", TEXTS["llama3_json"][1], None, NICE_1),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": 2}};', None, []),
    ("llama3_json", '{"name": "a"} {"name": "b"}', None, []),  # no separator
    *[("llama3_json", t, None, []) for t in TEXTS["llama3_json"][2:]],
    ("pythonic", TEXTS["pythonic"][0], None, ZONE_2),
    ("pythonic", TEXTS["pythonic"][1], None, NICE_1),
    ("pythonic", '[get_time(zone=None, when=[1, {"a": True}])]', None,
     [("get_time", {"zone": None, "when": [1, {"a": True}]})]),
    ("pythonic", "[]", None, []),
    ("pythonic", "[get_time(zone=__import__('os'))]", None, []),  # literals only
    ("pythonic", "[get_time(zone={1, 2})]", None, []),  # not JSON
    ("pythonic", "[get_time(**opts)]", None, []),
    ("pythonic", "[get_time(zone=1e999)]", None, []),  # Infinity: not JSON
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": NaN}}</tool_call>',
     None, []),
    *[("pythonic", t, None, []) for t in TEXTS["pythonic"][2:]],
    ("mistral", TEXTS["mistral"][0], None, ZONE_2),
    ("mistral", TEXTS["mistral"][1], "Let me check.", NICE_1),
    ("mistral", ' [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice", '
     '"unit": "c"}}, {"name": "get_time", "arguments": {"zone": 1}}]', None, NICE_1),
    *[("mistral", t, None, []) for t in TEXTS["mistral"][2:]],
])
def test_parsers(parser, text, content, calls):
    got_content, got = ToolPlan("auto", TOOLS, form=FORMATS[parser]).parse(text)
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
