"""A real heron server on 127.0.0.1 (ephemeral port) in a background thread, for sync tests.

The server runs its own event loop in a thread, so tests can drive it with the blocking
`openai` client and plain sockets, the way real clients do. Several servers (different
`[server]` settings) may share one loaded Engine, one at a time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
from aiohttp import web

from heron.core.config import Config, load_config
from heron.core.engine import Engine
from heron.server.app import RUNNER_OPTIONS, create_app
from heron.server.appkeys import ASYNC_ENGINE

CONF = Path(__file__).resolve().parent.parent / "conf"


def server_config(model_path, **overrides) -> Config:
    return load_config(CONF / "test.toml", {"model.path": str(model_path), **overrides})


class ServerThread:
    """``with ServerThread(config, engine) as server:`` serves until the block ends."""

    def __init__(self, config: Config, engine: Engine | None = None) -> None:
        self.config, self.engine = config, engine
        self.loop = asyncio.new_event_loop()
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=600)
        return self

    async def _start(self) -> None:
        self.app = create_app(self.config, engine=self.engine)
        self._runner = web.AppRunner(self.app, **RUNNER_OPTIONS)  # as `heron serve` runs it
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    # -- clients ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def async_engine(self):
        return self.app[ASYNC_ENGINE]

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key,
                             max_retries=kw.pop("max_retries", 0),
                             timeout=kw.pop("timeout", 120), **kw)

    def http(self, method: str, path: str, body: bytes | dict | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        """A raw request: (status, headers, body), 4xx/5xx included."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples without labels (and ``name{labels}`` keys for labelled)."""
        _, _, body = self.http("GET", "/metrics")
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_for(self, predicate, timeout_s: float = 30.0, interval_s: float = 0.05):
        """Poll ``predicate(metrics)`` until truthy; returns the last metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = self.metrics()
            if predicate(values) or time.monotonic() > deadline:
                return values
            time.sleep(interval_s)
