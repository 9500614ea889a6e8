"""The tutorial shows real code: every python, toml and cuda excerpt in README.md is found,
verbatim, in one of the template's files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(python|toml|cuda)\n(.*?)^```$", re.S | re.M)


def test_every_readme_excerpt_is_in_the_template():
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".toml", ".cu")]
    texts = [p.read_text() for p in files]
    excerpts = FENCE.findall((ROOT / "README.md").read_text())
    assert len(excerpts) >= 10
    stale = [body for _, body in excerpts if not any(body in text for text in texts)]
    assert not stale, "README excerpts not found in the template's files:\n" + "\n---\n".join(stale)
