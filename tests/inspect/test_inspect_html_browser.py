"""The HTML pages opened in headless Chromium: the script draws every op (DOM dump) and the
screenshot shows the coloured DAG. Skips when /usr/bin/chromium is not installed."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import numpy as np
import pytest
from inspect_helpers import traced_run

from asynccoll.inspect.kinds import build_all
from asynccoll.inspect.perfetto import timeline_page
from asynccoll.inspect.render import KIND_COLOR, render
from asynccoll.inspect.tracefile import load_dir

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="headless check needs /usr/bin/chromium"),
    pytest.mark.slow,
]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--hide-scrollbars", "--window-size=1400,900"]


def _chromium(*args: str) -> str:
    # subprocess.run kills the browser if it outlives the timeout
    r = subprocess.run([str(CHROMIUM), *FLAGS, *args], capture_output=True, text=True,
                       timeout=90, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _hex_rgb(h: str) -> np.ndarray:
    return np.array([int(h[i:i + 2], 16) for i in (1, 3, 5)], dtype=float)


@pytest.mark.timeout(180)
def test_schedule_page_renders(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot", reason="reading the PNG needs matplotlib")
    scheds = build_all("example-doubling", 4, 64)
    page = tmp_path / "dag.html"
    page.write_text(render(scheds, "html"))
    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.count('class="op"') == sum(len(s.ops) for s in scheds)
    assert dom.count('class="msg"') > 0
    shot = tmp_path / "dag.png"
    _chromium(f"--screenshot={shot}", page.as_uri())
    img = plt.imread(str(shot))[..., :3] * 255.0
    assert img.std() > 10  # not blank
    for kind in ("send", "recv", "compute"):  # the script drew nodes of every kind
        close = np.abs(img - _hex_rgb(KIND_COLOR[kind])).sum(axis=-1) < 30
        assert close.sum() > 200, kind


@pytest.mark.timeout(180)
def test_timeline_page_renders(tmp_path: Path) -> None:
    asyncio.run(traced_run(tmp_path / "t", build_all("example-doubling", 3, 64), 2))
    page = tmp_path / "tl.html"
    page.write_text(timeline_page(load_dir(tmp_path / "t")))
    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.count('class="op"') == 2 * (3 + sum(len(s.ops) for s in build_all(
        "example-doubling", 3, 64)))


@pytest.mark.timeout(180)
def test_eight_rank_schedule_page_fits_the_window_and_labels_each_or_once(
        tmp_path: Path) -> None:
    """The 8-rank solo page opens without scrolling (the DAG scaled into the window; the zoom
    buttons go from there), and each OR / k-of-n rule is written once, above its op, not on
    every incoming edge where the labels piled up."""
    import re

    from asynccoll.inspect.graph import dep_class

    scheds = build_all("solo", 8, 4096)
    page = tmp_path / "solo8.html"
    page.write_text(render(scheds, "html"))
    dom = _chromium("--dump-dom", page.as_uri())
    m = re.search(r'<svg[^>]*id="dag"[^>]*>', dom)
    assert m is not None
    tag = m.group(0)
    width = float(re.search(r' width="([\d.]+)"', tag).group(1))  # type: ignore[union-attr]
    height = float(re.search(r' height="([\d.]+)"', tag).group(1))  # type: ignore[union-attr]
    assert width <= 1400 - 360, tag  # the window less the side panel
    assert height <= 900 - 60, tag  # the window less the title and the legend
    rules = sum(1 for s in scheds for op in s.ops if dep_class(op) in ("or", "k-of-n"))
    assert rules > 0
    assert dom.count('class="dep-rule"') == rules
