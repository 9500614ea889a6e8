"""/v1/responses through the openai client (`client.responses`), on the tiny reasoning model
of `tests.test_server_reasoning`. Oracles: transformers' `apply_chat_template` for what
the input items render to and its greedy tokens for the output, `jsonschema` for answers
held to a schema; the stream's events must add up to the whole response."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
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
    assert out.output[0].status == "incomplete" and out.store is True
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
    ({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "not json"}]},
     "input[1].arguments"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format.schema"),
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


def test_previous_response_id_continues_the_stored_conversation(r1, oracle):
    """Each turn sends only its new input: the prompt is what transformers renders of the
    whole conversation (the earlier thinking and answers included, the earlier
    instructions not), and the answer is its greedy continuation. A streamed response is
    stored as a whole one is."""
    first = respond(r1, instructions="Be brief.", **biased(oracle, OPEN))
    assert first.store and [item.type for item in first.output] == ["reasoning", "message"]
    chat = [*ASK, _turn(first)]
    for turn, question in enumerate(["And 3 + 3?", "Thanks"]):
        chat.append({"role": "user", "content": question})
        kept = respond(r1, previous_response_id=first.id, input=question, stream=turn == 0,
                       instructions="Be kind.", **biased(oracle, OPEN))
        if turn == 0:
            *_, kept = replay(kept)
        prompt = oracle.prompt([{"role": "system", "content": "Be kind."}, *chat], OPEN)
        assert kept.usage.input_tokens == len(prompt)
        assert _turn(kept) == _turn(oracle.text(prompt).partition("</think>")[::2])
        assert kept.previous_response_id == first.id and kept.store
        chat.append(_turn(kept))
        first = kept


def _turn(answer) -> dict:
    """The assistant message of a response, or of transformers' (thinking, answer)."""
    if isinstance(answer, tuple):
        thought, text = answer
    else:
        thought = "".join(part.text for item in answer.output if item.type == "reasoning"
                          for part in item.content)
        text = answer.output_text
    return {"role": "assistant", "content": text,
            **({"reasoning_content": thought} if thought else {})}


def test_stored_responses_are_read_and_deleted_by_id(plain):
    client = plain.client()
    out = respond(plain, max_output_tokens=4)
    assert client.responses.retrieve(out.id).model_dump() == out.model_dump()
    later = respond(plain, previous_response_id=out.id, input="Thanks", max_output_tokens=4)
    status, _, raw = plain.http("DELETE", f"/v1/responses/{out.id}")
    assert status == 200 and json.loads(raw) == {"id": out.id, "object": "response.deleted",
                                                 "deleted": True}
    for method in ("GET", "DELETE"):
        status, _, raw = plain.http(method, f"/v1/responses/{out.id}")
        assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    # a response that continued the deleted one keeps the whole conversation
    last = respond(plain, previous_response_id=later.id, input="Bye", max_output_tokens=1)
    assert last.usage.input_tokens > later.usage.input_tokens + later.usage.output_tokens
    unkept = respond(plain, store=False, max_output_tokens=4)
    assert unkept.store is False
    status, _, raw = plain.http("GET", f"/v1/responses/{unkept.id}")
    assert status == 404
    for gone in (out.id, unkept.id):
        status, _, raw = plain.http("POST", "/v1/responses", {
            "model": "tiny", "input": "hi", "previous_response_id": gone})
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "previous_response_not_found", error
        assert error["param"] == "previous_response_id"


def test_input_items_list_the_conversation_a_response_answered(plain):
    """The SDK's ``responses.input_items.list``: the earlier turns' inputs and outputs, then
    this turn's input, each with an id that stays the same from one response to the next;
    newest first by default, a page at a time."""
    client = plain.client()
    first = respond(plain, input="What is 2 + 2?", max_output_tokens=4)
    [asked] = client.responses.input_items.list(first.id).data
    assert asked.type == "message" and asked.role == "user" and asked.status == "completed"
    assert [(p.type, p.text) for p in asked.content] == [("input_text", "What is 2 + 2?")]
    assert asked.id.startswith("msg_")
    new = [{"role": "user", "content": "And 3 + 3?"},
           {"type": "message", "role": "user", "id": "msg_mine",
            "content": [{"type": "input_text", "text": "Quickly."}]}]
    second = respond(plain, previous_response_id=first.id, input=new, max_output_tokens=4)
    oldest_first = client.responses.input_items.list(second.id, order="asc").data
    answer = [item.id for item in first.output]
    assert [item.id for item in oldest_first][:1 + len(answer)] == [asked.id, *answer]
    assert oldest_first[-1].id == "msg_mine"
    assert [p.text for item in oldest_first[-2:] for p in item.content] == ["And 3 + 3?",
                                                                          "Quickly."]
    newest_first = client.responses.input_items.list(second.id).data
    assert [item.id for item in newest_first] == [item.id for item in oldest_first][::-1]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [item.id for item in page.data] == [item.id for item in newest_first[:2]]
    assert page.has_more and (page.first_id, page.last_id) == (newest_first[0].id,
                                                               newest_first[1].id)
    rest = client.responses.input_items.list(second.id, after=page.last_id, limit=100,
                                             include=["message.input_image.image_url"])
    assert [item.id for item in rest.data] == [item.id for item in newest_first[2:]]
    assert not rest.has_more
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_none", "after"),
                         ("limit=many", "limit")):
        status, _, raw = plain.http("GET", f"/v1/responses/{second.id}/input_items?{query}")
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param, (query, error)
    status, _, raw = plain.http("GET", "/v1/responses/resp_none/input_items")
    assert status == 404 and json.loads(raw)["error"]["code"] == "response_not_found"


def _poll(client, response_id: str, timeout_s: float = 60.0):
    """The response once it has left "queued" and "in_progress"."""
    deadline = time.monotonic() + timeout_s
    while (out := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {out.status}"
        time.sleep(0.02)
    return out


def _idle(server) -> None:
    """Every engine request over and every KV block free (a background task may be ending)."""
    deadline = time.monotonic() + 10
    while server.async_engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.async_engine.num_requests == 0 and server.engine.num_blocks_in_use == 0


#: A background response that runs long enough to be caught running (ignore_eos).
LONG = {"input": "Tell me everything.", "max_output_tokens": 900, "extra_body": {"ignore_eos": True}}


def test_background_response_runs_on_and_is_polled_by_id(plain):
    """The POST answers "queued" at once; GET shows the response as the same request
    answered in the foreground, with its conversation kept for input_items."""
    client = plain.client()
    queued = respond(plain, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = _poll(client, queued.id)
    ref = respond(plain)
    assert done.status == ref.status and done.background and not ref.background
    assert done.output_text == ref.output_text
    assert (done.usage.input_tokens, done.usage.output_tokens) == (ref.usage.input_tokens,
                                                                   ref.usage.output_tokens)
    assert [item.role for item in client.responses.input_items.list(done.id).data] == ["user"]
    again = client.responses.cancel(done.id)  # one that ended comes back as it ended
    assert again.model_dump() == done.model_dump()
    later = respond(plain, previous_response_id=done.id, input="Thanks", max_output_tokens=4)
    assert later.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
    _idle(plain)


def test_background_responses_are_cancelled_and_deleted_while_running(plain):
    client = plain.client()
    running = respond(plain, background=True, **LONG)
    status, _, raw = plain.http("POST", "/v1/responses", {
        "model": "tiny", "input": "and?", "previous_response_id": running.id})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "previous_response_running", error
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 900
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"
    _idle(plain)
    doomed = respond(plain, background=True, **LONG)
    status, _, _ = plain.http("DELETE", f"/v1/responses/{doomed.id}")
    assert status == 200
    _idle(plain)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)
    foreground = respond(plain, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_none")


def test_background_refuses_what_it_cannot_keep(plain):
    status, _, raw = plain.http("POST", "/v1/responses", {
        "model": "tiny", "input": "hi", "background": True, "store": False})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "background", error


def test_a_streamed_background_response_is_streamed_again_from_any_event(plain, oracle):
    """The POST streams queued → in_progress → the output → the end; GET ?stream=true
    streams the same events again from any ``starting_after``, once it ended too."""
    client = plain.client()
    prompt = oracle.prompt(ASK)
    text = oracle.tokenizer.decode(oracle.greedy(prompt, 0.0), skip_special_tokens=True)
    events = list(respond(plain, background=True, stream=True))
    assert [e.type for e in events[:3]] == ["response.created", "response.queued",
                                            "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background
    types, texts, final = replay(events)
    assert list(texts.values()) == [text] and final.output_text == text
    assert final.model_dump() == client.responses.retrieve(final.id).model_dump()
    dumped = [e.model_dump() for e in events]
    again = client.responses.retrieve(final.id, stream=True)
    assert [e.model_dump() for e in again] == dumped
    for after in (0, 5, len(events) - 2, len(events) - 1):
        tail = client.responses.retrieve(final.id, stream=True, starting_after=after)
        assert [e.model_dump() for e in tail] == dumped[after + 1:]
    _idle(plain)


def test_a_streamed_background_response_runs_on_without_its_client(plain):
    """A client leaving the stream leaves the response running; another follows it live
    from where the first left and sees it to its end; a cancel ends every follower's
    stream, and the response shows "cancelled"."""
    client = plain.client()
    first = respond(plain, background=True, stream=True, **LONG)
    seen = [next(iter(first)) for _ in range(6)]
    first.close()
    response_id = seen[0].response.id
    rest = client.responses.retrieve(response_id, stream=True, starting_after=5)
    numbers = [next(iter(rest)).sequence_number for _ in range(20)]
    assert numbers == list(range(6, 26))
    assert client.responses.retrieve(response_id).status == "in_progress"
    cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 900
    last = list(rest)  # the stream ends (no last event for a cancel)
    assert all(e.type.endswith(".delta") for e in last)
    assert list(client.responses.retrieve(response_id, stream=True, starting_after=25)) == \
        [e for e in last]
    done = client.responses.retrieve(response_id)
    assert done.status == "cancelled" and done.output_text  # the output it had produced
    _idle(plain)


@pytest.mark.parametrize("query", ["stream=true", "stream=true&starting_after=-1",
                                   "stream=maybe"])
def test_only_streamed_background_responses_stream_again(plain, query):
    kept = respond(plain, max_output_tokens=2)
    status, _, raw = plain.http("GET", f"/v1/responses/{kept.id}?{query}")
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] in ("stream", "starting_after"), error


def test_a_background_response_past_the_deadline_fails(model_dir):
    with serve(model_dir, **{"server.request_timeout_s": 0.3}) as s:
        out = _poll(s.client(), respond(s, background=True, **LONG).id)
        assert out.status == "failed" and out.error.code == "request_timeout", out.error
        assert 0 < out.usage.output_tokens < 900
        _idle(s)


def test_a_streamed_response_past_the_deadline_ends_failed_and_is_kept(model_dir):
    """A foreground stream that fails ends with ``response.failed`` (its output so far and
    the error), and the response is stored as it ended."""
    with serve(model_dir, **{"server.request_timeout_s": 0.3}) as s:
        events = list(respond(s, stream=True, **LONG))
        last = events[-1]
        assert last.type == "response.failed", [e.type for e in events[-3:]]
        assert last.response.error.code == "request_timeout", last.response.error
        assert 0 < last.response.usage.output_tokens < 900
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        kept = s.client().responses.retrieve(last.response.id)
        assert kept.status == "failed" and kept.error.code == "request_timeout"
        assert kept.output_text == last.response.output_text
        _idle(s)


def test_a_server_stopping_ends_its_background_responses(model_dir):
    with serve(model_dir) as s:
        running = respond(s, background=True, **LONG)
        assert running.status == "queued"
        engine = s.engine
    assert engine.num_blocks_in_use == 0 and not engine.has_unfinished()


def test_a_running_background_response_is_not_dropped_for_room(model_dir):
    """Past the store's capacity the least recently used response that has ended goes,
    never one still running: it stays readable and cancellable, and goes once it ends."""
    with serve(model_dir, **{"server.max_stored_responses": 1}) as s:
        client = s.client()
        running = respond(s, background=True, **LONG)
        first, second = respond(s, max_output_tokens=1), respond(s, max_output_tokens=1)
        assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        assert client.responses.retrieve(second.id).id == second.id
        assert client.responses.cancel(running.id).status == "cancelled"
        respond(s, max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):  # ended, and least recently used
            client.responses.retrieve(running.id)
        _idle(s)


def test_each_tenant_sees_its_own_responses_and_the_store_keeps_the_newest(model_dir):
    tenants = {"acme": ["key-a"], "globex": ["key-g"]}
    with serve(model_dir, **{"server.tenants": tenants, "server.max_stored_responses": 2}) as s:
        acme, globex = s.client("key-a"), s.client("key-g")
        ask = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
        a1, a2 = (acme.responses.create(**ask) for _ in range(2))
        with pytest.raises(openai.NotFoundError):
            globex.responses.retrieve(a1.id)
        with pytest.raises(openai.BadRequestError) as refused:
            globex.responses.create(**ask, previous_response_id=a1.id)
        assert refused.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            globex.responses.delete(a1.id)
        with pytest.raises(openai.NotFoundError):
            globex.responses.input_items.list(a1.id)
        with pytest.raises(openai.NotFoundError):
            globex.responses.cancel(a1.id)
        acme.responses.retrieve(a1.id)  # now the most recently used: a2 goes first
        acme.responses.create(**ask)
        assert acme.responses.retrieve(a1.id).id == a1.id
        with pytest.raises(openai.NotFoundError):
            acme.responses.retrieve(a2.id)
    with serve(model_dir, **{"server.max_stored_responses": 0}) as s:
        out = s.client().responses.create(**ask)
        assert out.store is False
        with pytest.raises(openai.NotFoundError):
            s.client().responses.retrieve(out.id)
