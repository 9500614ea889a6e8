"""The ``heron`` command line: help, `heron config`, start-up rejections, and a real `serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import openai
import pytest

from heron.core.config import load_config
from heron.server.cli import build_parser, main
from tests.tiny_models import build_tiny

CONF = Path(__file__).resolve().parent.parent / "conf"
HERON = Path(sys.executable).with_name("heron")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_command_and_option(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    for command in ("serve", "config", "plugins", "generate", "kernels", "fetch-model"):
        assert command in out
    code, out, _ = run_main(capsys, "serve", "--help")
    assert code == 0
    for option in ("model", "--config", "--set", "--host", "--port", "--chat-template"):
        assert option in out


def test_config_prints_the_effective_config_as_toml(capsys, tmp_path):
    overrides = ["engine.num_kv_blocks=64", "server.host=0.0.0.0", "logging.format=json"]
    argv = ["config", "--config", str(CONF / "test.toml")]
    for item in overrides:
        argv += ["--set", item]
    code, out, _ = run_main(capsys, *argv, "/models/m.gguf")
    assert code == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    tomllib.loads(out)
    expected = load_config(CONF / "test.toml", overrides + ["model.path=/models/m.gguf"])
    assert load_config(printed) == expected
    assert expected.server.host == "0.0.0.0" and expected.engine.num_kv_blocks == 64


def test_config_hides_api_keys_and_reads_them_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("HERON_API_KEYS", "sk-env-1, sk-env-2")
    code, out, _ = run_main(capsys, "config", "--set", 'server.api_keys=["sk-file"]')
    assert code == 0 and "sk-" not in out and "# api_keys = (3 hidden)" in out


@pytest.mark.parametrize("text, key, reason", [
    ("[server]\nprot = 8000\n", "prot", "unknown field"),
    ("[server]\nport = \"eighty\"\n", "port", "Expected `int`"),
    ("[server]\nport = 70000\n", "port", "must be in 0..65535"),
    ("[server]\nmax_waiting_requests = 0\n", "max_waiting_requests", "must be >= 1"),
    ("[server]\nmax_body_bytes = 10\n", "max_body_bytes", "must be >= 1024"),
    ("[server]\napi_keys = \"sk-one\"\n", "api_keys", "Expected `array`"),
    ("[server]\napi_keys = [\"\"]\n", "api_keys", "must not contain an empty key"),
    ("[logging]\nlevel = \"loud\"\n", "level", "Invalid enum value"),
    ("[logging]\nlog_requests = \"yes\"\n", "log_requests", "Expected `bool`"),
    ("[engine]\nblock_size = 0\n", "block_size", "must be in 1..1024"),
    ("[serve]\nport = 1\n", "serve", "unknown field"),
])
def test_serve_rejects_bad_config_with_exit_2(capsys, tmp_path, text, key, reason):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, _, err = run_main(capsys, "serve", "--config", str(path))
    assert code == 2
    assert str(path) in err and key in err and reason in err


@pytest.mark.parametrize("command", ["config", "serve"])
def test_an_unknown_speculative_method_is_a_config_error(capsys, command):
    code, out, err = run_main(capsys, command, "--set", 'speculative.method="eagle"')
    assert code == 2 and not out
    assert "'eagle' is not registered" in err and "'mtp'" in err and "'ngram'" in err
    code, out, _ = run_main(capsys, "config", "--set", 'speculative.method="ngram"')
    assert code == 0 and 'method = "ngram"' in out


def test_serve_rejects_bad_overrides_and_missing_models(capsys, tmp_path):
    code, _, err = run_main(capsys, "serve", "--set", "server.port=-1")
    assert code == 2 and "port" in err
    code, _, err = run_main(capsys, "serve", str(tmp_path / "missing.gguf"))
    assert code == 2 and "missing.gguf" in err
    code, _, err = run_main(capsys, "serve", "--port", "nope")
    assert code == 2 and "--port" in err
    code, _, err = run_main(capsys, "serve", "--chat-template", str(tmp_path / "chat.jinja"))
    assert code == 2 and "chat.jinja' is neither a file nor a Jinja template" in err
    code, _, err = run_main(capsys, "serve", "--chat-template", "{% if %}")
    assert code == 2 and "model.chat_template: " in err


def test_chat_template_flag_sets_the_model_key(capsys, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    code, out, _ = run_main(capsys, "config", "--chat-template", str(template))
    assert code == 0 and tomllib.loads(out)["model"]["chat_template"] == str(template)


@pytest.fixture
def keep_logging(monkeypatch):
    """`serve` configures logging for the process: not for the test session's."""
    monkeypatch.setattr("heron.server.logs.configure_logging", lambda config: None)


def test_user_errors_are_one_line_not_tracebacks(capsys, tmp_path, default_gguf_path,
                                                 keep_logging):
    """Bad arguments exit 2, unreadable models 1; either way one line that names what is
    wrong (the file, the flag), before any long work starts."""
    code, _, err = run_main(capsys, "generate", "--prompt", "hi", "--max-tokens", "0")
    assert code == 2 and err.strip() == "heron generate: error: --max-tokens is out of range: 0"
    code, _, err = run_main(capsys, "generate", "--prompt", "", "--max-tokens", "3")
    assert code == 2 and "--prompt must not be empty" in err
    model = tmp_path / "tiny"
    build_tiny("llama", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short
    for argv in (["generate", str(model), "--prompt", "hi"], ["serve", str(model), "--port", "0"]):
        code, _, err = run_main(capsys, *argv)
        assert code == 1 and "safetensors file is unreadable" in err and str(model) in err
    (model / "config.json").write_text("{not json")
    code, _, err = run_main(capsys, "generate", str(model), "--prompt", "hi")
    assert code == 1 and "not valid JSON" in err
    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    code, _, err = run_main(capsys, "generate", str(cut), "--prompt", "hi")
    assert code == 1 and err.startswith(f"heron: error: {cut}: not a complete GGUF file")
    code, _, err = run_main(capsys, "train-mtp", str(cut), "--out", str(tmp_path))
    assert code == 1 and "is a directory" in err
    code, _, err = run_main(capsys, "train-mtp", str(cut), "--out", "x", "--prompts", "0")
    assert code == 1 and "num_prompts must be >= 1" in err
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("kind,task,route", [("llama", "embed", "/v1/embeddings"),
                                             ("llama-cls", "classify", "/classify")])
def test_generate_refuses_a_model_that_embeds_or_classifies(capsys, tmp_path, keep_logging,
                                                            kind, task, route):
    build_tiny(kind, tmp_path)
    code, _, err = run_main(capsys, "generate", str(tmp_path), "--prompt", "hi",
                            "--set", f'model.task="{task}"')
    assert code == 2 and "generates nothing" in err and route in err


def test_a_port_in_use_is_named(capsys, tmp_path, keep_logging):
    build_tiny("llama", tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_main(capsys, "serve", str(tmp_path), "--port", str(port))
    assert code == 1 and f"cannot listen on 127.0.0.1:{port} (server.host, server.port)" in err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_heron_serve_runs_until_interrupted(tmp_path):
    model = tmp_path / "tiny"
    build_tiny("llama", model)
    port = free_port()
    proc = subprocess.Popen(
        [str(HERON), "serve", str(model), "--config", str(CONF / "test.toml"),
         "--port", str(port), "--set", "server.served_model_name=tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HERON_API_KEYS": ""})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "heron serve did not come up"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        out = client.chat.completions.create(model="tiny", max_tokens=5,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert out.usage.completion_tokens <= 5
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    request = next(line for line in lines if line["event"] == "request")
    assert request["model"] == "tiny" and request["completion_tokens"] == out.usage.completion_tokens
    assert request["prompt_tokens"] == out.usage.prompt_tokens and request["level"] == "info"


def test_a_signal_while_loading_stops_with_a_message(tmp_path):
    """SIGTERM before the server listens: a log line that says so, then the signal's exit
    status (a load cannot be interrupted; it is slowed here so that the signal lands in it)."""
    model = tmp_path / "tiny"
    build_tiny("llama", model)
    code = ("import sys, time; import heron.core.engine as e\n"
            "def slow(self, *a, **k):\n"
            "    print('LOADING', file=sys.stderr, flush=True); time.sleep(60)\n"
            "e.Engine.__init__ = slow\n"
            "from heron.server.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", str(model), "--config", str(CONF / "test.toml"),
         "--port", str(free_port())], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HERON_API_KEYS": ""})
    try:
        assert proc.stderr.readline().strip() == "LOADING"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(line["event"] == "stopped while loading the model"
               and line["signal"] == "SIGTERM" for line in lines), err


def test_parser_builds_without_loading_the_server():
    code = ("import sys; from heron.server.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('aiohttp', 'transformers', 'openai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert build_parser().prog == "heron"


def test_train_mtp_passes_only_the_options_given_each_a_keyword_of_the_recipe():
    import inspect

    from heron.plugins.mtp.train import train_mtp
    from heron.server.cli import _TRAIN_MTP_OPTIONS, train_mtp_settings
    assert _TRAIN_MTP_OPTIONS <= set(inspect.signature(train_mtp).parameters)
    args = build_parser().parse_args(["train-mtp", "--out", "h.safetensors", "--copy-prompts",
                                      "0", "--samples", "s.pt"])
    assert train_mtp_settings(args) == {"num_copy_prompts": 0, "samples_file": Path("s.pt")}

