"""A reasoning model's thinking through the openai client: a tiny model whose tokenizer has
<think> and </think> and whose chat template opens or closes the thinking as Qwen3's and
DeepSeek-R1's do. Oracles: transformers' greedy tokens (under the same logit bias, which
makes the random model write </think> a few tokens in) split with `str.partition`, its
`apply_chat_template` for prompts, and `jsonschema` for the answers held to a schema."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

TEMPLATE = (
    "{%- if reasoning_effort is defined %}<s>system: reasoning {{ reasoning_effort }}\n"
    "{% endif %}"
    "{%- if tools %}<s>system: tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<s>assistant:"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- elif open_thinking is defined and open_thinking %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
OPEN = {"open_thinking": True}  # the template opens the thinking, as R1's does
OFF = {"enable_thinking": False}  # it closes it: thinking off, as Qwen3's can
MAX_TOKENS = 40
ANSWER = {"type": "object", "additionalProperties": False, "required": ["sum"],
          "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-reasoning")
    build_tiny("llama", path, std=0.15, max_position_embeddings=1024)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # 300 and 301, inside the model's 320
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def oracle(model_dir):
    return Oracle(model_dir)


class Oracle:
    """transformers' rendering and greedy tokens, and the bias under which the thinking
    ends a few tokens in."""

    def __init__(self, path) -> None:
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.end = self.tokenizer.convert_tokens_to_ids("</think>")
        prompt = self.prompt(ASK, OPEN)
        self.bias = next((b for b in (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
                          if 3 <= self._end_at(prompt, b) <= MAX_TOKENS - 10), None)
        assert self.bias is not None, "no bias makes the model end its thinking mid-output"

    def prompt(self, messages, kwargs=None, tools=None) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, tools=tools,
                                                  add_generation_prompt=True,
                                                  **(kwargs or {}))["input_ids"]

    def greedy(self, prompt: list[int], bias: float, budget: int | None = None) -> list[int]:
        """Greedy tokens of a prompt that opened the thinking; with a ``budget``, </think>
        once the thinking holds that many tokens."""
        tokens = []
        with torch.no_grad():
            out = self.model(torch.tensor([prompt]), use_cache=True)
            while len(tokens) < MAX_TOKENS:
                logits = out.logits[0, -1].float()
                logits[self.end] += bias
                spent = budget is not None and len(tokens) >= budget and self.end not in tokens
                tokens.append(self.end if spent else int(logits.argmax()))
                if tokens[-1] == self.tokenizer.eos_token_id:
                    break
                out = self.model(torch.tensor([tokens[-1:]]),
                                 past_key_values=out.past_key_values, use_cache=True)
        return tokens

    def _end_at(self, prompt, bias) -> int:
        tokens = self.greedy(prompt, bias)
        return tokens.index(self.end) if self.end in tokens else -1

    def text(self, prompt, budget: int | None = None) -> str:
        return self.tokenizer.decode(self.greedy(prompt, self.bias, budget),
                                     skip_special_tokens=True)


def serve(model_dir, parser: str):
    config = server_config(model_dir, **{"server.served_model_name": "tiny",
                                         "server.reasoning_parser": parser})
    return ServerThread(config, Engine(config))


@pytest.fixture(scope="module")
def r1(model_dir):
    with serve(model_dir, "deepseek_r1") as server:
        yield server.client()


def chat(client, oracle, kwargs=None, **kw):
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    args = {"model": "tiny", "messages": ASK, "temperature": 0.0, "max_tokens": MAX_TOKENS,
            "logit_bias": {str(oracle.end): oracle.bias}, "extra_body": extra, **kw}
    return client.chat.completions.create(**args)


def streamed(chunks) -> tuple[str, str, list[str]]:
    """The stream's reasoning and content, and which came in what order."""
    reasoning, content, order = "", "", []
    for chunk in chunks:
        for choice in chunk.choices:
            if piece := getattr(choice.delta, "reasoning", None):
                reasoning += piece
                order.append("reasoning")
            if piece := choice.delta.content:
                content += piece
                order.append("content")
            if choice.delta.tool_calls:
                order.append("tool_calls")
    return reasoning, content, order


def test_the_thinking_and_the_answer_split_where_the_model_ends_its_thinking(r1, oracle):
    prompt = oracle.prompt(ASK, OPEN)
    reasoning, marker, content = oracle.text(prompt).partition("</think>")
    assert marker and reasoning and content and not reasoning.lstrip().startswith("<think>")
    out = chat(r1, oracle, OPEN)
    assert out.usage.prompt_tokens == len(prompt)
    thinking_tokens = oracle.greedy(prompt, oracle.bias).index(oracle.end) + 1
    assert out.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    message = out.choices[0].message
    assert (message.reasoning, message.content) == (reasoning, content)
    chunks = list(chat(r1, oracle, OPEN, stream=True, stream_options={"include_usage": True}))
    s_reasoning, s_content, order = streamed(chunks)
    assert (s_reasoning, s_content) == (reasoning, content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    assert order.index("content") > max(i for i, k in enumerate(order) if k == "reasoning")


def test_a_thinking_token_budget_ends_the_thinking(r1, oracle):
    """vLLM's `thinking_token_budget`: </think> once the thinking holds that many tokens,
    then the answer; a budget the thinking does not reach changes nothing, and a prompt
    that turned thinking off has none to cap."""
    prompt = oracle.prompt(ASK, OPEN)
    natural = oracle.greedy(prompt, oracle.bias).index(oracle.end)
    for budget in (0, 2, natural - 1, natural):
        reasoning, marker, content = oracle.text(prompt, budget).partition("</think>")
        assert marker and content
        extra = {"thinking_token_budget": budget}
        out = chat(r1, oracle, OPEN, extra_body={"chat_template_kwargs": OPEN, **extra})
        message = out.choices[0].message
        assert (message.reasoning, message.content) == (reasoning or None, content), budget
        assert out.usage.completion_tokens_details.reasoning_tokens == min(budget, natural) + 1
        chunks = chat(r1, oracle, OPEN, stream=True,
                      extra_body={"chat_template_kwargs": OPEN, **extra})
        assert streamed(chunks)[:2] == (reasoning, content), budget
    assert oracle.text(prompt, natural) == oracle.text(prompt)
    off = chat(r1, oracle, OFF, extra_body={"chat_template_kwargs": OFF,
                                            "thinking_token_budget": 0}).choices[0].message
    assert (off.reasoning, off.content) == (None, oracle.text(oracle.prompt(ASK, OFF)))
    with pytest.raises(openai.BadRequestError, match="not supported with beam search"):
        chat(r1, oracle, OPEN, n=2, extra_body={"thinking_token_budget": 2,
                                                "use_beam_search": True})


def test_a_prompt_that_closes_the_thinking_gets_all_content(r1, oracle):
    prompt = oracle.prompt(ASK, OFF)
    text = oracle.text(prompt)
    out = chat(r1, oracle, OFF)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    assert (out.choices[0].message.reasoning, out.choices[0].message.content) == (None, text)
    assert streamed(chat(r1, oracle, OFF, stream=True))[:2] == ("", text)


def test_a_prompt_that_does_not_say_follows_the_parser(r1, oracle, model_dir):
    """deepseek_r1: the output starts in its thinking; qwen3: it thinks only if it opens
    with <think>, which this model does not."""
    text = oracle.text(oracle.prompt(ASK))
    assert "</think>" in text and not text.lstrip().startswith("<think>")
    reasoning, _, content = text.partition("</think>")
    message = chat(r1, oracle).choices[0].message
    assert (message.reasoning, message.content) == (reasoning, content)
    with serve(model_dir, "qwen3") as server:
        message = chat(server.client(), oracle).choices[0].message
        assert (message.reasoning, message.content) == (None, text)
        # a grammar holds the answer from the start, <think> allowed first
        out = chat(server.client(), oracle, response_format=_schema(), max_tokens=200)
        jsonschema.validate(json.loads(out.choices[0].message.content), ANSWER)


def _schema():
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def test_a_schema_holds_the_answer_and_leaves_the_thinking_free(r1, oracle):
    reasoning, marker, _ = oracle.text(oracle.prompt(ASK, OPEN)).partition("</think>")
    assert marker and reasoning
    out = chat(r1, oracle, OPEN, response_format=_schema(), max_tokens=200)
    choice = out.choices[0]
    assert choice.message.reasoning == reasoning and choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    s_reasoning, s_content, _ = streamed(chat(r1, oracle, OPEN, response_format=_schema(),
                                              max_tokens=200, stream=True))
    assert (s_reasoning, s_content) == (reasoning, choice.message.content)


def test_a_named_call_comes_after_the_thinking(r1, oracle):
    named = {"type": "function", "function": {"name": "add"}}
    prompt = oracle.prompt(ASK, OPEN, tools=[TOOL])
    reasoning, marker, _ = oracle.text(prompt).partition("</think>")
    assert marker and reasoning
    out = chat(r1, oracle, OPEN, tools=[TOOL], tool_choice=named, max_tokens=200)
    assert out.usage.prompt_tokens == len(prompt)
    choice = out.choices[0]
    assert choice.message.reasoning == reasoning and choice.message.content is None
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert choice.finish_reason == "tool_calls"
    chunks = list(chat(r1, oracle, OPEN, tools=[TOOL], tool_choice=named, max_tokens=200,
                       stream=True))
    s_reasoning, _, order = streamed(chunks)
    pieces = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert s_reasoning == reasoning
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert order.index("tool_calls") > max(i for i, k in enumerate(order) if k == "reasoning")


def test_earlier_thinking_in_the_history_reaches_the_template(r1, oracle):
    for field in ("reasoning", "reasoning_content"):
        history = ASK + [{"role": "assistant", "content": "4", field: "2 and 2 make 4"},
                         {"role": "user", "content": "And 3 + 3?"}]
        expected = oracle.prompt([*history[:1], {"role": "assistant", "content": "4",
                                                 "reasoning_content": "2 and 2 make 4"},
                                  history[2]], OPEN)
        out = chat(r1, oracle, OPEN, messages=history, max_tokens=1)
        assert out.usage.prompt_tokens == len(expected), field


def test_reasoning_effort_reaches_the_template(r1, oracle):
    """Chat's `reasoning_effort` and the Responses API's `reasoning.effort` render as the
    template's `reasoning_effort`; `chat_template_kwargs` setting it wins."""
    client = r1

    def prompt_of(kwargs=None, **kw):
        extra = {"return_token_ids": True, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        return client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1,
                                              extra_body=extra, **kw).prompt_token_ids

    assert prompt_of(reasoning_effort="high") == oracle.prompt(ASK, {"reasoning_effort": "high"})
    assert prompt_of({"reasoning_effort": "low"}, reasoning_effort="high") == oracle.prompt(
        ASK, {"reasoning_effort": "low"})
    assert prompt_of() == oracle.prompt(ASK)
    minimal = oracle.prompt(ASK, {"reasoning_effort": "minimal"})
    assert len(minimal) != len(oracle.prompt(ASK))
    out = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=1,
                                  reasoning={"effort": "minimal"})
    assert out.usage.input_tokens == len(minimal) and out.reasoning.effort == "minimal"


def test_anthropic_messages_give_the_thinking_its_own_block(model_dir, oracle):
    """/v1/messages: with a reasoning parser the thinking is a ``thinking`` block before
    the answer's ``text`` block, whole or streamed (its deltas in order)."""
    thought, _, answer = oracle.tokenizer.decode(
        oracle.greedy(oracle.prompt(ASK, OPEN), 0.0), skip_special_tokens=True).partition(
        "</think>")
    assert thought and answer  # unbiased, this model ends its thinking early
    with serve(model_dir, "deepseek_r1") as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        args = dict(model="tiny", max_tokens=MAX_TOKENS, messages=ASK, extra_body={
            "temperature": 0.0, "chat_template_kwargs": OPEN})
        out = client.messages.create(**args)
        assert [b.type for b in out.content] == ["thinking", "text"]
        assert out.content[0].thinking == thought and out.content[1].text == answer.strip()
        with client.messages.stream(**args) as stream:
            deltas = [(e.index, e.delta.type) for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert sorted(set(deltas)) == [(0, "thinking_delta"), (1, "text_delta")]
        assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
                for b in final.content] == [("thinking", thought, None),
                                            ("text", None, answer.strip())]
        # `budget_tokens` caps the thinking as chat's `thinking_token_budget` does
        natural = oracle.greedy(oracle.prompt(ASK, OPEN), 0.0).index(oracle.end)
        assert natural >= 2
        thought, _, answer = oracle.tokenizer.decode(
            oracle.greedy(oracle.prompt(ASK, OPEN), 0.0, natural - 1),
            skip_special_tokens=True).partition("</think>")
        out = client.messages.create(**args, thinking={"type": "enabled",
                                                       "budget_tokens": natural - 1})
        assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
                for b in out.content] == [("thinking", thought, None),
                                          ("text", None, answer.strip())]
