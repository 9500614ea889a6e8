"""``heron serve``: serve until SIGTERM or SIGINT, then drain and stop.

A drain keeps the listening socket open, so that clients get an answer rather than a
refused connection: new requests get 503 (/health too, so a load balancer stops sending
them). Requests already accepted may run for up to ``server.drain_timeout_s`` (or until a
second signal); whatever is left then is aborted (its client gets a 503, or an error event
on a stream). Then the server closes its connections, stops the engine and `serve` returns.
"""

from __future__ import annotations

import asyncio
import os
import signal

import structlog
from aiohttp import web

from heron.core.config import Config
from heron.server.app import RUNNER_OPTIONS, create_app
from heron.server.appkeys import ASYNC_ENGINE

log = structlog.get_logger("heron.server")

#: After the drain, how long aborted requests get to send their last bytes.
_CLOSE_TIMEOUT_S = 5.0


async def serve(config: Config) -> None:
    app = create_app(config)
    runner = web.AppRunner(app, shutdown_timeout=_CLOSE_TIMEOUT_S, **RUNNER_OPTIONS)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop_while_loading, sig)
    await runner.setup()  # loads the model
    try:
        site = web.TCPSite(runner, config.server.host, config.server.port)
        try:
            await site.start()
        except OSError as e:
            raise OSError(f"cannot listen on {config.server.host}:{config.server.port} "
                          f"(server.host, server.port): {e.strerror or e}") from e
        log.info("listening", host=config.server.host, port=runner.addresses[0][1])
        signalled = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled.set)
        await signalled.wait()
        async_engine = app[ASYNC_ENGINE]
        log.info("draining", requests=async_engine.num_requests,
                 timeout_s=config.server.drain_timeout_s)
        again = asyncio.Event()  # a second signal cuts the drain short
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, again.set)
        drain = asyncio.ensure_future(async_engine.drain(config.server.drain_timeout_s))
        cut = asyncio.ensure_future(again.wait())
        await asyncio.wait((drain, cut), return_when=asyncio.FIRST_COMPLETED)
        drain.cancel()
        cut.cancel()
        if again.is_set():
            log.warning("second signal: the drain is cut short")
        if async_engine.num_requests:
            log.warning("aborting requests still running after the drain",
                        requests=async_engine.num_requests)
        await async_engine.stop()
    finally:
        await runner.cleanup()
    log.info("stopped")


def _stop_while_loading(sig: signal.Signals) -> None:
    """A signal before the server listens: there is nothing to drain, and the loading thread
    cannot be interrupted, so say why and die of the signal (its usual exit status)."""
    log.warning("stopped while loading the model", signal=sig.name)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
