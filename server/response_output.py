"""A response's output items, built as its text comes, with the stream events that say so.

One item grows at a time: the thinking (a ``reasoning`` item), then the answer (a
``message``) or its function calls. Each method returns the events of what it did: an
item's ``output_item.added`` (and ``content_part.added``) when it opens, a delta per
piece, and its ``.done`` events when the next item opens or the output ends (`close`).
A whole answer goes through the same calls, its events unsent, so a streamed response
ends as the whole one would be.
"""

from __future__ import annotations

import uuid

from heron.server.response_protocol import (ArgumentsDelta, ArgumentsDone, ContentPartAdded,
                                            ContentPartDone, Event, OutputFunctionCall,
                                            OutputItem, OutputItemAdded, OutputItemDone,
                                            OutputMessage, OutputReasoning, OutputText,
                                            OutputTextDelta, OutputTextDone, ReasoningText,
                                            ReasoningTextDelta, ReasoningTextDone)

__all__ = ["OutputBuilder"]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """The output items of one response (``items``) and the events that build them."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None  # the item still growing

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def reasoning(self, text: str) -> list[Event]:
        """The next piece of the thinking."""
        return self._text(text, OutputReasoning, ReasoningText, ReasoningTextDelta, "rs")

    def message(self, text: str) -> list[Event]:
        """The next piece of the answer's text."""
        return self._text(text, OutputMessage, OutputText, OutputTextDelta, "msg")

    def _text(self, text: str, item_type, part_type, delta_type, prefix: str) -> list[Event]:
        if not text:
            return []
        events = []
        if not isinstance(self._open, item_type):
            events += self._start(item_type(id=_item_id(prefix), content=[part_type(text="")],
                                            status="in_progress"), part_type(text=""))
        item = self._open
        item.content[0].text += text
        return events + [delta_type(item_id=item.id, output_index=self._index, delta=text)]

    def call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        """The next piece of call ``call_id``'s arguments (a new call for a new id)."""
        events = []
        item = self._open
        if not isinstance(item, OutputFunctionCall) or item.call_id != call_id:
            events += self._start(OutputFunctionCall(id=_item_id("fc"), call_id=call_id,
                                                     name=name, arguments="",
                                                     status="in_progress"), None)
            item = self._open
        if arguments:
            item.arguments += arguments
            events.append(ArgumentsDelta(item_id=item.id, output_index=self._index,
                                         delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """End the growing item (with ``status``: "incomplete" when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        index, events = self._index, []
        if isinstance(item, OutputReasoning):
            part = item.content[0]
            events += [ReasoningTextDone(item_id=item.id, output_index=index, text=part.text),
                       ContentPartDone(item_id=item.id, output_index=index, part=part)]
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            events += [OutputTextDone(item_id=item.id, output_index=index, text=part.text),
                       ContentPartDone(item_id=item.id, output_index=index, part=part)]
        else:
            events.append(ArgumentsDone(item_id=item.id, output_index=index, name=item.name,
                                        arguments=item.arguments))
        return events + [OutputItemDone(output_index=index, item=item)]

    def _start(self, item: OutputItem, part: OutputText | ReasoningText | None) -> list[Event]:
        events = self.close()
        self.items.append(item)
        self._open = item
        # the events show the item as it opens: empty, before any piece lands in it
        opened = (OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name,
                                     arguments="", status="in_progress")
                  if part is None else type(item)(id=item.id, content=[], status="in_progress"))
        events.append(OutputItemAdded(output_index=self._index, item=opened))
        if part is not None:
            events.append(ContentPartAdded(item_id=item.id, output_index=self._index, part=part))
        return events
