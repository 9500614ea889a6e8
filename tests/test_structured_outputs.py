"""Structured outputs on a tiny random model: the oracles are transformers' forward with
llguidance's own per-token mask (`compute_logit_bias`, not the bitmask heron unpacks) for
greedy tokens, and `jsonschema` / `re` for what sampled outputs must match."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer

from heron.core.sampling_params import ReasoningGate, SamplingParams, StructuredOutput
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.test_speculative import NGRAM, OracleProposer
from tests.tiny_models import build_tiny

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"cat": {"type": "boolean"}},
                "required": ["cat"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no way", "caf\u00e9 \"au\" lait"]
LARK = 'start: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'
SPECS = {
    "json": StructuredOutput(json=SCHEMA),
    "json-object": StructuredOutput(json={"type": "object", "maxProperties": 2,
                                          "patternProperties": {"^[a-z]{1,3}$": {"type": "integer"}},
                                          "additionalProperties": False}),
    "regex": StructuredOutput(regex=REGEX),
    "choice": StructuredOutput(choice=CHOICES),
    "lark": StructuredOutput(grammar=LARK),
}
PROMPTS = ["The quick brown fox", "def add(a, b):", "Caf\u00e9", "emoji", "Paged attention"]
MAX_TOKENS = 160


def check(kind: str, text: str) -> None:
    """``text`` is what ``SPECS[kind]`` allows, by an oracle other than llguidance."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json-object":
        value = json.loads(text)
        assert isinstance(value, dict) and len(value) <= 2, text
        assert all(re.fullmatch("[a-z]{1,3}", k) and type(v) is int
                   for k, v in value.items()), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text), text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = build_tiny("llama", path, std=0.15)
    return path, model


def guided(kind: str, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0,
                             "structured_outputs": SPECS[kind], **kw})


def hf_guided_greedy(model, path, prompt_ids: list[int], spec: StructuredOutput,
                     gate: ReasoningGate | None = None) -> list[int]:
    """transformers' forward with its KV cache; each step's logits masked by llguidance's
    byte mask, argmax, until the grammar is complete (or EOS in a free thinking). With a
    reasoning ``gate``, the mask waits for the thinking's end, and the first token may
    also be the thinking's start."""
    vocab = model.config.vocab_size
    tokenizer = LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=[2])
    if spec.json is not None:
        grammar = LLMatcher.grammar_from_json_schema(spec.json,
                                                     defaults={"whitespace_flexible": False})
    elif spec.regex is not None:
        grammar = LLMatcher.grammar_from_regex(spec.regex)
    else:
        grammar = LLMatcher.grammar_from_lark(spec.grammar)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    thinking = gate is not None and gate.open
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        while not matcher.is_stopped() and len(tokens) < MAX_TOKENS:
            logits = out.logits[0, -1].float()
            if not thinking:
                allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()),
                                           dtype=torch.uint8)[:vocab].clone()
                if gate is not None and not tokens:
                    allowed[gate.start_token_id] = 1
                logits = logits.masked_fill(allowed == 0, float("-inf"))
            tokens.append(int(logits.argmax()))
            if thinking:
                if tokens[-1] == 2:
                    break
                thinking = tokens[-1] != gate.end_token_id
            elif gate is not None and len(tokens) == 1 and tokens[0] == gate.start_token_id:
                thinking = True
            else:
                assert matcher.consume_token(tokens[-1])
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens


def test_greedy_tokens_match_transformers_under_llguidance_masks(tiny):
    path, model = tiny
    engine = make_engine(path, **{"engine.block_size": 8})
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    kinds = ["json", "regex", "lark", None]  # and a request without one, in the same batch
    outs = engine.generate(prompts, [guided(k) if k else SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True) for k in kinds])
    for prompt, kind, out in zip(prompts, kinds, outs):
        if kind is None:
            continue
        expected = hf_guided_greedy(model, path, prompt, SPECS[kind])
        assert out.outputs[0].token_ids == expected, kind
        assert out.outputs[0].finish_reason == "stop"
        check(kind, out.outputs[0].text)
    assert_no_leaks(engine)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_sampled_outputs_match_their_grammar(tiny, kind):
    path, _ = tiny
    engine = make_engine(path)
    outs = engine.generate(PROMPTS, guided(kind, temperature=1.0, seed=11, n=2))
    texts = [c.text for out in outs for c in out.outputs]
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(kind, c.text)
    assert len(set(texts)) > 1  # sampling, not one forced answer
    assert_no_leaks(engine)


def test_preemption_keeps_each_grammar_where_it_was(tiny):
    """A pool too small for the batch: preempted sequences recompute their KV and go on
    from the same grammar state (the same greedy tokens as without preemption)."""
    path, _ = tiny
    params = [guided(kind, max_tokens=120) for kind in ("json", "json", "json", "lark")]
    plain = make_engine(path).generate(PROMPTS[:4], params)
    engine = make_engine(path, **{"engine.block_size": 4, "engine.num_kv_blocks": 40})
    outs = engine.generate(PROMPTS[:4], params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for kind, out in zip(("json", "json", "json", "lark"), outs):
        if out.outputs[0].finish_reason == "stop":
            check(kind, out.outputs[0].text)
    assert_no_leaks(engine)


def test_drafts_give_the_same_outputs(tiny):
    """Verification samples draft positions one by one, each under the grammar's state
    after the tokens accepted before it."""
    path, _ = tiny
    prompts = [make_engine(path).tokenizer.encode(p) for p in PROMPTS]
    params = [guided("json", temperature=0.8, seed=i) for i in range(len(prompts))]
    plain_engine = make_engine(path)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        plain_engine.add_request(f"r{i}", ids, p)
    plain = run_to_end(plain_engine)
    continuations = [plain[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    engine = make_engine(path, **NGRAM)
    engine.proposer = OracleProposer(prompts, continuations)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", ids, p)
    done = run_to_end(engine)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == continuations
    assert engine.spec_stats.accepted_tokens > 0
    assert_no_leaks(engine)


def test_invalid_specs_and_beams_are_refused(tiny):
    path, _ = tiny
    engine = make_engine(path)
    for spec, error in [(StructuredOutput(regex="("), "regex is not valid"),
                        (StructuredOutput(json={"type": "bogus"}), "JSON schema is not valid"),
                        (StructuredOutput(grammar="start: undefined_rule"),
                         "Lark grammar is not valid"),
                        (StructuredOutput(regex="a", choice=["a"]), "exactly one"),
                        (StructuredOutput(), "exactly one")]:
        with pytest.raises(ValueError, match=error):
            engine.add_request("r", "Hi", SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="structured_outputs is not supported with beam"):
        engine.add_request("b", "Hi", SamplingParams(num_beams=2, structured_outputs=SPECS["regex"]))
    assert engine.num_requests == 0
    assert engine.generate(["Hi"], guided("choice"))[0].outputs[0].text in CHOICES
    assert_no_leaks(engine)


def test_compiled_grammars_are_kept_and_handed_out_as_copies(tiny):
    """A repeated spec reuses its compiled grammar: each sequence gets its own copy in the
    start state, and only the last ``cache_size`` specs are kept."""
    path, _ = tiny
    engine = make_engine(path)
    grammars = engine.grammars
    grammars.cache_size = 2
    first = grammars.compile(StructuredOutput(choice=["yes", "no"]))
    second = grammars.compile(StructuredOutput(choice=["yes", "no"]))
    assert second is not first and len(grammars._compiled) == 1
    for token in engine.tokenizer.encode("yes", add_special_tokens=False):
        assert first.consume_token(token)
    assert first.is_stopped() and not second.is_stopped()
    assert grammars.compile(StructuredOutput(choice=["yes", "no"])).is_stopped() is False
    for spec in [SPECS["regex"], SPECS["lark"], StructuredOutput(regex="(")]:
        try:
            grammars.compile(spec)
        except ValueError:
            pass
    assert len(grammars._compiled) == 2  # the valid two; the choice list was dropped
    outputs = engine.generate(["Hi", "Paged"], guided("choice", n=2, temperature=1.0, seed=1))
    assert all(o.text in CHOICES for out in outputs for o in out.outputs)
    assert_no_leaks(engine)


def test_thinking_is_free_and_the_answer_is_held_to_the_grammar(tiny):
    """A reasoning gate: tokens up to the end of the thinking are the model's own (the
    unguided greedy run's), the rest are the grammar's; an output whose first token does
    not open the thinking is held to the grammar from the start."""
    path, model = tiny
    engine = make_engine(path)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0].token_ids
    end = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    thought = free[:free.index(end) + 1]
    plain = engine.generate([prompt], guided("json"))[0].outputs[0].token_ids
    with torch.no_grad():  # a start the model would not pick first
        unlikely = int(model(torch.tensor([prompt])).logits[0, -1].argmin())
    cases = [(ReasoningGate(start_token_id=unlikely, end_token_id=end, open=True), thought),
             (ReasoningGate(start_token_id=free[0], end_token_id=end), thought),
             (ReasoningGate(start_token_id=unlikely, end_token_id=end), [])]
    outs = engine.generate([prompt] * 3, [guided("json", reasoning=gate) for gate, _ in cases])
    for (gate, thinking), out in zip(cases, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_guided_greedy(model, path, prompt, SPECS["json"], gate)
        assert tokens[:len(thinking)] == thinking
        check("json", engine.tokenizer.decode(tokens[len(thinking):]))
        assert out.outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].token_ids == plain
    assert_no_leaks(engine)
