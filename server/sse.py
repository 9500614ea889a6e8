"""Server-sent events in the OpenAI streaming format: ``data: <json>`` events, ``[DONE]``.

A stream that fails after it started cannot change its status code any more, so it ends
with an ``{"error": {...}}`` event (which the openai client raises as an APIError), then
``[DONE]``: never a silent cut.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import structlog
from aiohttp import web

from heron.server.errors import APIError

_DONE = b"data: [DONE]\n\n"

log = structlog.get_logger("heron.server")


class EventStream:
    done: bytes | None = _DONE  # the stream's last line (None: none)

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold events back
        })
        self.is_finished = False

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, body: msgspec.Struct, event: str | None = None) -> None:
        """Raises ConnectionResetError once the client has gone. ``event``: the event's name
        (the Responses API names each)."""
        await self.send_encoded(msgspec.json.encode(body), event)

    async def send_encoded(self, data: bytes, event: str | None = None) -> None:
        """`send` of a body already encoded as JSON."""
        named = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self.response.write(named + b"data: " + data + b"\n\n")

    async def fail(self, error: APIError) -> None:
        await self.send(error.body())
        await self.finish()

    async def finish(self) -> None:
        self.is_finished = True
        if self.done is not None:
            await self.response.write(self.done)
        await self.response.write_eof()

    async def run(self, produce: Callable[[], Awaitable[msgspec.Struct | None]]
                  ) -> web.StreamResponse:
        """Start the stream, let ``produce`` send its events, then end with ``[DONE]``.

        ``produce`` returns a last chunk to send first (the usage chunk) or None, and may end
        the stream itself with `fail`. An exception after the start ends the stream with an
        error event; a client that went away ends it quietly (leaving the Generation aborts
        what still runs).
        """
        await self.start()
        try:
            final = await produce()
            if not self.is_finished:
                if final is not None:
                    await self.send(final)
                await self.finish()
        except ConnectionResetError:
            pass
        except Exception as e:  # after the status line: say so in the stream
            await self.fail_after_error(e)
        return self.response

    async def fail_after_error(self, e: Exception) -> None:
        """End the stream after an exception in its handler (APIErrors are sent as they are)."""
        if not isinstance(e, APIError):
            log.exception("stream failed", path=self.request.path)
            e = APIError(500, "internal server error")
        try:
            await self.fail(e)
        except ConnectionResetError:
            pass
