"""The default real model (SmolLM2-135M-Instruct) behind the server and the openai client.

The config names no model, so this also shows that the server falls back to the default
model exactly as `heron serve` without MODEL does.
"""

from __future__ import annotations

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
