"""``make docs`` (docs/pictures.py) draws every picture the docs show, from the current code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "docs" / "pictures.py"


def _drawn() -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.split()


@pytest.mark.timeout(90)
def test_every_picture_shown_is_drawn_by_the_script() -> None:
    shown = {m for md in (ROOT / "docs").glob("*.md")
             for m in re.findall(r"\]\(img/([^)\s]+)\)", md.read_text())}
    assert shown, "the docs show pictures from docs/img"
    assert shown <= set(_drawn()), f"not drawn by docs/pictures.py: {sorted(shown - set(_drawn()))}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_script_draws_every_picture(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True,
                   timeout=150, cwd=tmp_path)
    for name in _drawn():
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert len(data) > 10_000, name
