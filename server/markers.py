"""Markers a model writes into its text (``<think>``, ``<tool_call>``), read as it streams."""

from __future__ import annotations

__all__ = ["marker_prefix"]


def marker_prefix(text: str, marker: str) -> int:
    """The length of the longest proper prefix of ``marker`` that ``text`` ends with: the
    tail to hold back until the next piece shows whether the marker follows."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if text.endswith(marker[:k])), 0)
