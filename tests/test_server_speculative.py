"""Speculative decoding through the server: the `openai` client sees the same completions
with drafts and without (per-request opt-out), and /metrics counts the drafts."""

from __future__ import annotations

import json

import pytest

from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny("llama", path)
    config = server_config(path, **{"server.served_model_name": "tiny",
                                    "speculative.method": "ngram",
                                    "speculative.prompt_lookup_min": 1})
    with ServerThread(config, Engine(config)) as s:
        yield s


def test_completions_are_the_same_with_and_without_drafts(server):
    client = server.client()
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0)
    with_drafts = client.completions.create(**kw)
    without = client.completions.create(**kw, extra_body={"speculative": False})
    assert with_drafts.choices[0].text == without.choices[0].text
    assert with_drafts.usage.completion_tokens == without.usage.completion_tokens == 24
    stream = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == without.choices[0].text
    metrics = server.metrics()
    drafts = metrics["heron_spec_decode_drafts_total"]
    proposed = metrics["heron_spec_decode_draft_tokens_total"]
    accepted = metrics["heron_spec_decode_accepted_tokens_total"]
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed
    assert metrics["heron_spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert metrics["heron_spec_decode_mean_accepted_length"] == pytest.approx(
        1 + accepted / drafts)
    per_position = sum(v for k, v in metrics.items()
                       if k.startswith("heron_spec_decode_accepted_tokens_per_position_total"))
    assert per_position == accepted


def test_a_bad_speculative_field_is_a_400(server):
    status, _, body = server.http("POST", "/v1/completions",
                                  {"model": "tiny", "prompt": "x", "speculative": "sometimes"})
    assert status == 400 and "speculative" in json.loads(body)["error"]["message"]
