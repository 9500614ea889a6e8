"""Responses kept for ``previous_response_id`` and ``/v1/responses/{id}`` (``GET``,
``DELETE``, ``input_items``, ``cancel``): finished ones, and background ones at each state
they reach; in memory, the newest ``server.max_stored_responses`` of them (least recently
used first out), each seen only by the tenant whose request made it. Background responses
that still run are kept beside those (dropped, they could no longer be read, followed or
cancelled) and count once they have ended.

An entry holds its response and the whole conversation up to it as input items: the
previous response's items, this request's input (each named with an id if it came without
one), this response's output. Items are shared between the entries of one conversation (a
tuple of references), so a long conversation costs its text once, and dropping an entry
never breaks the entries that continue it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from heron.server.response_protocol import Response

if TYPE_CHECKING:
    from heron.server.response_background import EventLog

Item = dict[str, Any]  # an input item, as `heron.server.responses_api.conversation` reads it

#: The states of a background response that has not ended.
RUNNING = ("queued", "in_progress")


@dataclass(frozen=True)
class StoredResponse:
    response: Response
    conversation: tuple[Item, ...]  # instructions are not in it: they do not carry over
    events: EventLog | None = None  # a background response made with `stream: true`


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def put(self, tenant: str, stored: StoredResponse) -> None:
        """Keep ``stored``; past ``capacity`` ended responses, drop the least recently used."""
        key = (tenant, stored.response.id)
        self._entries[key] = stored
        self._entries.move_to_end(key)
        ended = [k for k, s in self._entries.items() if s.response.status not in RUNNING]
        for old in ended[:max(0, len(ended) - self.capacity)]:
            del self._entries[old]

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        stored = self._entries.get((tenant, response_id))
        if stored is not None:
            self._entries.move_to_end((tenant, response_id))
        return stored

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._entries.pop((tenant, response_id), None) is not None
