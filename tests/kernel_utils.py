"""Helpers for the CPU kernel tests."""

from __future__ import annotations

import pytest


def vector_widths(module, name: str):
    """A fixture that makes ``module.name``, a kernel loader taking ``vec_floats`` after its
    other arguments, build its kernels for vectors of 8 floats (AVX2's registers) and then of
    16 (AVX-512's), whatever this machine's: each width's code runs on every machine."""

    @pytest.fixture(params=[8, 16], ids=["8-wide", "16-wide"])
    def vector_width(request, monkeypatch):
        load = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args: load(*args, request.param))
        return request.param

    return vector_width
