"""Background responses (``background: true``): the POST answers at once with the response
"queued", the generation runs on in a task of its own, and ``GET /v1/responses/{id}`` shows
it "in_progress" and then "completed", "incomplete", "failed" (with its error) or
"cancelled" (``POST /v1/responses/{id}/cancel``). Each state is kept in the response store
as it is reached, so a background response must be stored.

The running ones are held here by (tenant, response id): a cancel aborts one's engine
requests and waits for its task to keep the "cancelled" response; the server's shutdown
ends those left (after the drain, which waits for them as for any request).

A background response made with ``stream: true`` also logs its events (`EventLog`), kept
with the response: the POST streams them, and ``GET /v1/responses/{id}?stream=true``
streams them again from any point (``starting_after``), live until the response ends. The
client leaving a stream stops only its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import structlog

if TYPE_CHECKING:  # generation imports the app's keys, which hold this registry
    from heron.server.generation import Generation
    from heron.server.response_protocol import Event

log = structlog.get_logger("heron.server.responses")

Key = tuple[str, str]  # (tenant, response id)


class EventLog:
    """The events of one background response, numbered and encoded once as they are added,
    for any number of readers, each from where it likes; `close` when the response has
    ended."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes]] = []  # (name, JSON)
        self.closed = False
        self._changed = asyncio.Event()

    def add(self, event: Event) -> None:
        event.sequence_number = len(self.events)
        self.events.append((event.__struct_config__.tag, msgspec.json.encode(event)))
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # the next wait waits for what comes next

    async def follow(self, after: int | None = None) -> AsyncIterator[tuple[str, bytes]]:
        """The events (name, JSON) numbered past ``after`` (None: all), then each as it
        comes, until the log is closed."""
        i = 0 if after is None else after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._changed.wait()


@dataclass
class _Run:
    gen: Generation
    task: asyncio.Task


class BackgroundResponses:
    def __init__(self) -> None:
        self._runs: dict[Key, _Run] = {}

    async def start(self, key: Key, gen: Generation,
                    body: Callable[[], Awaitable[None]]) -> None:
        """Submit ``gen`` (its admission errors raise here, for the POST to answer), then run
        ``body`` in a task that outlives the request; leaving ``gen`` (aborting what still
        runs, its metrics and log line) comes when ``body`` ends."""
        admitted = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with gen:
                    admitted.set_result(None)
                    await body()
            except Exception as e:
                if not admitted.done():
                    admitted.set_exception(e)
                else:  # `body` keeps every outcome it expects; this is a bug, logged
                    log.exception("background response failed", id=key[1])
            finally:
                self._runs.pop(key, None)
                if not admitted.done():  # ended (the server stopping) before it was admitted
                    admitted.cancel()

        self._runs[key] = _Run(gen, asyncio.create_task(run(), name=f"heron-{key[1]}"))
        await admitted

    async def cancel(self, key: Key) -> None:
        """Stop the response running under ``key`` (none: nothing to do) and wait until its
        task has kept how it ended."""
        run = self._runs.get(key)
        if run is not None:
            run.gen.cancel()
            await asyncio.wait([run.task])

    async def close(self) -> None:
        """End every response still running (the server stops)."""
        runs = list(self._runs.values())
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs), return_exceptions=True)
