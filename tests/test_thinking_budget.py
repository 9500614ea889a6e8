"""A thinking token budget (``SamplingParams.thinking_token_budget``) on a real engine: once
the thinking holds that many tokens its end token comes next, and the output goes on from
there. The thinking's markers are two tokens of a tiny random llama's own vocabulary (a
`ReasoningGate`). Oracle: transformers' greedy tokens under the same rule, written out
below; seeded sampling against the engine's own run without a budget."""

from __future__ import annotations

import json

import pytest
import torch

from heron.core.sampling_params import ReasoningGate, SamplingParams, StructuredOutput
from tests.engine_utils import assert_no_leaks, make_engine, run_to_end
from tests.test_speculative import NGRAM, OracleProposer
from tests.tiny_models import build_tiny

MAX_TOKENS = 24
PROMPT = [1, 17, 93, 42, 250, 8, 61]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = build_tiny("llama", path, std=0.15)
    return path, model


@pytest.fixture(scope="module")
def engine(tiny):
    return make_engine(tiny[0])


@pytest.fixture(scope="module")
def free(engine) -> list[int]:
    """The greedy output with no budget, and no end of the thinking in it."""
    return greedy(engine, None, None)


def greedy(engine, gate: ReasoningGate | None, budget: int | None, **kw) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            reasoning=gate, thinking_token_budget=budget, **kw)
    return engine.generate([PROMPT], params)[0].outputs[0].token_ids


def hf_greedy(model, gate: ReasoningGate, budget: int | None) -> list[int]:
    """transformers' forward with its KV cache and argmax, except that the end token is
    forced once the thinking (open from the start, or opened by the first token) holds
    ``budget`` tokens, its markers aside."""
    tokens, thinking, count = [], gate.open, 0
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)
        while len(tokens) < MAX_TOKENS:
            spent = thinking and budget is not None and count >= budget
            token = gate.end_token_id if spent else int(out.logits[0, -1].argmax())
            tokens.append(token)
            if len(tokens) == 1 and token == gate.start_token_id:
                thinking = True
            elif thinking:
                thinking = token != gate.end_token_id
                count += thinking
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens


def unused(free: list[int], nth: int = 0) -> int:
    """The ``nth`` token the free output never writes (a thinking's end it never reaches)."""
    return [t for t in range(3, 300) if t not in free][nth]


@pytest.mark.parametrize("budget", [0, 1, 5, MAX_TOKENS])
def test_a_thinking_open_from_the_prompt_ends_at_its_budget(tiny, engine, free, budget):
    _, model = tiny
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    tokens = greedy(engine, gate, budget)
    assert tokens == hf_greedy(model, gate, budget)
    if budget < MAX_TOKENS:
        assert tokens[:budget] == free[:budget] and tokens[budget] == gate.end_token_id
    else:  # never spent: the output is the free one
        assert tokens == free
    assert_no_leaks(engine)


def test_an_output_that_opens_its_thinking_counts_from_its_second_token(tiny, engine, free):
    _, model = tiny
    end = unused(free)
    opened = ReasoningGate(start_token_id=free[0], end_token_id=end)
    tokens = greedy(engine, opened, 3)
    assert tokens == hf_greedy(model, opened, 3)
    assert tokens[:4] == free[:4] and tokens[4] == end
    # an output whose first token does not open it has no thinking to cap
    unopened = ReasoningGate(start_token_id=end + 1, end_token_id=end)
    assert greedy(engine, unopened, 0) == free


def test_the_thinking_ends_by_itself_within_its_budget(tiny, engine, free):
    """A natural end before the budget is spent: nothing is forced, then or after."""
    end = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=end, open=True)
    assert greedy(engine, gate, free.index(end)) == free  # the end is the budget's last
    assert greedy(engine, gate, free.index(end) - 1) != free


def test_seeded_sampling_keeps_its_draws_up_to_the_forced_end(engine, free):
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    kw = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2)
    plain = engine.generate([PROMPT], SamplingParams(**kw))[0].outputs
    capped = engine.generate([PROMPT], SamplingParams(**kw, reasoning=gate,
                                                      thinking_token_budget=6))[0].outputs
    for a, b in zip(plain, capped):
        assert gate.end_token_id not in a.token_ids[:6]
        assert b.token_ids[:6] == a.token_ids[:6] and b.token_ids[6] == gate.end_token_id
    assert capped[0].token_ids != capped[1].token_ids
    assert_no_leaks(engine)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_drafts_past_the_budget_give_way_to_the_end(tiny, free, proposer):
    """Drafts that run on through the budget are rejected where the end is forced: the
    tokens are those without speculation."""
    path, _ = tiny
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    budgets = [2, 5, 9]
    expected = [greedy(make_engine(path), gate, b) for b in budgets]
    engine = make_engine(path, **NGRAM)
    if proposer == "oracle":  # drafts the free output, on past each budget
        engine.proposer = OracleProposer([PROMPT], [free])
    for budget, tokens in zip(budgets, expected):
        assert greedy(engine, gate, budget) == tokens
    assert engine.spec_stats.accepted_tokens > 0
    assert_no_leaks(engine)


def test_async_scheduling_forces_the_same_end(tiny, engine, free):
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    overlapped = make_engine(tiny[0], **{"engine.async_scheduling": "on"})
    assert greedy(overlapped, gate, 4) == greedy(engine, gate, 4)
    assert_no_leaks(overlapped)


def test_a_grammar_holds_the_answer_after_a_capped_thinking(engine, free):
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    params = SamplingParams(max_tokens=160, temperature=0.0, reasoning=gate,
                            thinking_token_budget=3,
                            structured_outputs=StructuredOutput(json=schema))
    out = engine.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids[:4] == [*free[:3], gate.end_token_id]
    assert isinstance(json.loads(engine.tokenizer.decode(out.token_ids[4:]))["n"], int)
    assert out.finish_reason == "stop"


def test_requests_with_and_without_a_budget_share_a_batch(engine, free):
    gate = ReasoningGate(start_token_id=unused(free), end_token_id=unused(free, 1), open=True)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                             reasoning=gate, thinking_token_budget=b) for b in (None, 2, 0)]
    for i, p in enumerate(params):
        engine.add_request(f"mixed-{i}", PROMPT, p)
    done = run_to_end(engine)
    assert done["mixed-0"].outputs[0].token_ids == free
    for i, budget in ((1, 2), (2, 0)):
        assert done[f"mixed-{i}"].outputs[0].token_ids == greedy(engine, gate, budget)
    assert_no_leaks(engine)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(thinking_token_budget=4), "thinking_token_budget needs `reasoning`"),
    (SamplingParams(thinking_token_budget=-1, reasoning=ReasoningGate(
        start_token_id=5, end_token_id=6)), "thinking_token_budget is out of range"),
    (SamplingParams(reasoning=ReasoningGate(start_token_id=5, end_token_id=10**6)),
     "reasoning: the thinking's tokens 5 and 1000000 must be in the vocabulary"),
    (SamplingParams(num_beams=2, thinking_token_budget=4, reasoning=ReasoningGate(
        start_token_id=5, end_token_id=6)), "thinking_token_budget is not supported with beam"),
])
def test_a_budget_the_engine_cannot_keep_is_refused(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("refused", PROMPT, params)
    assert engine.num_requests == 0
