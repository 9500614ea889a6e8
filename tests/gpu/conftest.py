"""GPU tests: everything marked ``gpu`` is skipped without a CUDA device (and cupy)."""

from __future__ import annotations

import importlib.util

import pytest


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return "needs cupy (pip install cupy-cuda12x or cupy-cuda13x)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
