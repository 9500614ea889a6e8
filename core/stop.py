"""Stop strings for streaming output.

Text arrives in deltas (one per token, roughly), and a stop string may span several of them.
`StopChecker` therefore holds back the shortest tail that could still grow into a stop
string, and emits everything before it. When a stop string completes, the output is cut
exactly before it (or just after it with ``include_stop_str_in_output``), and generation
should end.

Which stop wins: the one that starts earliest in the text; at the same start, the first in
the ``stop`` list. A complete match is not reported while a stop string that would win over
it could still complete (the text from its start is held back until the text decides), so
the answer never depends on how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopChecker"]


class StopChecker:
    """Per-sequence stop-string state.

    Invariants: ``feed`` never emits text that a later feed could reveal to be part of a stop
    string; when no stop string has matched, at most ``max(len(s) for s in stop) - 1``
    characters are held back; emitted text + held text == all fed text (until a match).
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]  # empty strings would match anywhere
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""
        self.matched: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.matched is not None

    def _partials(self, text: str) -> list[tuple[int, int]]:
        """(start, stop index) for every stop string that text[start:] is a proper prefix of."""
        longest = max(len(s) for s in self.stop)
        return [(i, k) for i in range(max(0, len(text) - longest + 1), len(text))
                for k, s in enumerate(self.stop) if len(s) > len(text) - i and s.startswith(text[i:])]

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Add ``new_text``; return ``(text_to_emit, matched_stop_or_None)``.

        After a match the sequence is finished; feeding again is a caller bug (RuntimeError).
        """
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched; the sequence is finished")
        if not self.stop:
            return new_text, None
        text = self.held + new_text
        found = [(i, k) for k, s in enumerate(self.stop) if (i := text.find(s)) >= 0]
        best = min(found) if found else None  # earliest start, then list order
        partials = self._partials(text)
        # NOTE: a stop that could still complete and would outrank `best` must be waited for,
        # or the answer would depend on how the text was split into feeds.
        if best is not None and not any(p < best for p in partials):
            start, stop = best[0], self.stop[best[1]]
            self.matched, self.held = stop, ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return text[:end], stop
        cut = min(partials)[0] if partials else len(text)
        self.held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        """At the end of generation: the held-back text, to emit last.

        Held text can still contain a complete stop string that was waiting on a longer one
        which now can never complete; then the text is cut there too and `matched` is set,
        exactly as if the text had ended differently.
        """
        held, self.held = self.held, ""
        if self.matched is not None or not self.stop:
            return held
        found = [(i, k) for k, s in enumerate(self.stop) if (i := held.find(s)) >= 0]
        if not found:
            return held
        start, k = min(found)
        self.matched = self.stop[k]
        return held[:start + (len(self.matched) if self.include_stop_str_in_output else 0)]
