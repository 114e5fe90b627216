"""docs/benchmarks.md is a page a user reads: a table at a glance, then per benchmark the
command, its table and one picture that exists; the dated work logs live in the history."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def test_benchmarks_page_is_current_tables_with_a_picture_each() -> None:
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 400
    secs = _sections(text)
    glance = secs.pop("At a glance")
    assert "peers in the same run" in glance
    for title, body in secs.items():
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", title) is None, f"a dated log: {title}"
        assert "python bench/" in body, f"{title}: no command"
        pics = re.findall(r"!\[[^\]]*\]\((img/[^)]+)\)", body)
        assert len(pics) == 1, f"{title}: {pics}"
        assert (DOCS / pics[0]).exists(), pics[0]
        assert "|---|" in body, f"{title}: no table"
    assert "benchmarks-history.md" in text
    history = (DOCS / "benchmarks-history.md").read_text(encoding="utf-8")
    assert "## The bandwidth issue's targets, 2026-11-28" in history
