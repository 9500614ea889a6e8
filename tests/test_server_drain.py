"""SIGTERM / SIGINT drain a real ``heron serve`` process: new requests get 503 while the
requests already running finish (or, past ``server.drain_timeout_s``, end with a clear
error), and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.test_cli import CONF, HERON, free_port
from tests.tiny_models import build_tiny

LONG = dict(model="tiny", prompt="The quick brown fox", temperature=0.0,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny("llama", path, max_position_embeddings=4096)
    return path


class Server:
    def __init__(self, model, drain_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(HERON), "serve", str(model), "--config", str(CONF / "test.toml"),
             "--port", str(self.port), "--set", "server.served_model_name=tiny",
             "--set", f"server.drain_timeout_s={drain_timeout_s}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "HERON_API_KEYS": ""})
        deadline = time.monotonic() + 180
        while self.get("/health")[0] != 200:
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "heron serve did not come up"
            time.sleep(0.25)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def get(self, path: str) -> tuple[int | None, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
        except OSError:
            return None, {}

    def stream_in_background(self, max_tokens: int) -> tuple[threading.Thread, dict]:
        """Start a stream; return once its first chunk arrived."""
        result, started = {}, threading.Event()

        def consume():
            chunks = []
            try:
                for chunk in self.client.completions.create(
                        stream=True, stream_options={"include_usage": True},
                        max_tokens=max_tokens, **LONG):
                    chunks.append(chunk)
                    started.set()
            except openai.APIError as e:
                result["error"] = e
            result["chunks"] = chunks
            started.set()

        thread = threading.Thread(target=consume)
        thread.start()
        assert started.wait(60)
        return thread, result

    def stop(self) -> tuple[int, list[dict]]:
        _, err = self.proc.communicate(timeout=60)
        logs = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
        return self.proc.returncode, logs


def test_sigterm_drains_running_requests_and_refuses_new_ones(model):
    server = Server(model, drain_timeout_s=60)
    thread, result = server.stream_in_background(max_tokens=1500)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, body = server.get("/health")
    assert status == 503 and body["error"]["code"] == "shutting_down"
    with pytest.raises(openai.APIStatusError) as refused:
        server.client.completions.create(max_tokens=2, **LONG)
    assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
    assert "shutting down" in refused.value.message
    thread.join(120)
    assert "error" not in result
    *_, last, usage = result["chunks"]
    assert last.choices[0].finish_reason == "length"  # ran to its end
    assert usage.usage.completion_tokens == 1500
    code, logs = server.stop()
    assert code == 0
    events = [line["event"] for line in logs]
    assert events.index("draining") < events.index("stopped")


@pytest.mark.parametrize("drain_timeout_s, second_signal, event", [
    (0.3, False, "aborting requests still running after the drain"),
    (60, True, "second signal: the drain is cut short"),
], ids=["timeout", "second-signal"])
def test_a_drain_cut_short_ends_running_requests_with_an_error(model, drain_timeout_s,
                                                               second_signal, event):
    server = Server(model, drain_timeout_s=drain_timeout_s)
    thread, result = server.stream_in_background(max_tokens=2000)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM if second_signal else signal.SIGINT)
    if second_signal:
        time.sleep(0.3)
        assert server.get("/health")[1]["error"]["code"] == "shutting_down"
        server.proc.send_signal(signal.SIGINT)
    thread.join(60)
    assert time.monotonic() - start < 20  # not the 60 s drain, nor the 2000 tokens
    assert "shutting down" in str(result["error"])  # an error event, not a silent cut
    assert all(c.choices[0].finish_reason is None for c in result["chunks"] if c.choices)
    code, logs = server.stop()
    assert code == 0 and any(line["event"] == event for line in logs)
