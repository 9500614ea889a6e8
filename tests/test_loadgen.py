"""`bench/loadgen.py` against a real heron server (tiny model): counts, turns, errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.loadgen import Request, load_workload, run, stats
from heron.core.engine import Engine
from tests.server_utils import ServerThread, server_config
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-loadgen")
    build_tiny("llama", path, std=0.15)
    config = server_config(path, **{"server.served_model_name": "tiny"})
    with ServerThread(config, Engine(config)) as s:
        yield s


def test_file_workload_counts_every_token(server, tmp_path):
    items = [{"prompt": f"The number {i} is"} for i in range(3)]
    items += [{"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}]
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(i) for i in items))
    workload = load_workload(str(path), None, 6)
    assert [r.max_tokens for r in workload] == [6, 6, 6, 4]
    summary = asyncio.run(run(server.url, workload, concurrency=2, ignore_eos=True,
                              progress=False))
    assert summary["model"] == "tiny"
    assert (summary["completed"], summary["errors"]) == (4, {})
    assert summary["output_tokens"] == 3 * 6 + 4
    assert summary["prompt_tokens"] > 0
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert summary["itl_ms"]["mean"] > 0 and summary["tpot_ms"]["mean"] > 0


def test_conversations_send_their_history(server):
    workload = [Request(5, messages=[{"role": "user", "content": "Hi"}],
                        follow_ups=["And then?", "Why?"])]
    summary = asyncio.run(run(server.url, workload, request_rate=100.0, concurrency=1,
                              ignore_eos=True, progress=False))
    assert (summary["requests"], summary["completed"]) == (3, 3)
    assert summary["output_tokens"] == 15
    # each turn re-sends the earlier ones and the answers: prompts grow
    first = asyncio.run(run(server.url, [Request(5, messages=[{"role": "user", "content": "Hi"}])],
                            concurrency=1, ignore_eos=True, progress=False))
    assert summary["prompt_tokens"] > 3 * first["prompt_tokens"]


def test_rejected_requests_are_counted_not_fatal(server):
    workload = [Request(4, prompt="ok"), Request(-1, prompt="bad max_tokens")]
    summary = asyncio.run(run(server.url, workload, concurrency=2, progress=False))
    assert summary["completed"] == 1
    assert summary["errors"] == {"http 400": 1}
    assert "max_tokens" in summary["error_examples"][0]


def test_workload_validation_and_stats(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps([{"prompt": "a", "messages": []}]))
    with pytest.raises(ValueError, match="item 0"):
        load_workload(str(path), None, 8)
    with pytest.raises(ValueError, match="short-chat"):
        load_workload("no-such-workload", None, 8)
    assert len(load_workload("multi-turn", 3, 8)) == 3
    assert stats([0.001, 0.002, 0.003])["p50"] == pytest.approx(2.0)
    assert stats([])["mean"] is None
