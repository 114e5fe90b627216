"""The trace views a person reads: the runtime's own collectives hidden unless ``--all``, the
PNG timeline named by collective in ms with a legend, the HTML timeline's colour legend."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynccoll.cli import main
from asynccoll.inspect.perfetto import timeline_page, timeline_png
from asynccoll.inspect.tracefile import load_dir
from asynccoll.inspect.visible import INTERNAL, user_traces
from asynccoll.testing import local_world


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("views")

    async def run() -> None:
        async with local_world(4, trace=str(d), timeout=20) as comms:
            x = np.ones(64, np.float32)
            await asyncio.wait_for(asyncio.gather(*(c.allreduce(x) for c in comms)), 20)
            await asyncio.wait_for(asyncio.gather(*(c.allreduce(x) for c in comms)), 20)

    asyncio.run(run())
    return d


def _names(traces: Any) -> set[str]:
    return {str(rec.get("collective")) for rt in traces.values()
            for rec in rt.schedules.values()}


@pytest.mark.timeout(60)
def test_internal_collectives_are_hidden_unless_all(
        trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    every = load_dir(trace_dir)
    assert "agree" in _names(every)  # the first use's definition check
    assert _names(user_traces(every)) == {"allreduce"}
    assert _names(user_traces(every, show_all=True)) == _names(every)
    assert main(["inspect", "trace", str(trace_dir)]) == 0
    out = capsys.readouterr().out
    assert "agree (sched_id" not in out, out
    assert "allreduce (sched_id" in out, out
    assert "hidden: agree; --all shows them" in out, out
    assert main(["inspect", "trace", str(trace_dir), "--all"]) == 0
    out = capsys.readouterr().out
    assert "agree (sched_id" in out, out
    assert set(INTERNAL) >= {"hosts", "agree"}


@pytest.mark.timeout(60)
def test_png_timeline_names_the_collective_in_ms_with_a_legend(
        trace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    seen: dict[str, Any] = {}
    save = Figure.savefig

    def spy(fig: Figure, *a: Any, **k: Any) -> None:
        ax = fig.axes[0]
        seen["yticks"] = [t.get_text() for t in ax.get_yticklabels()]
        seen["xlabel"] = ax.get_xlabel()
        seen["title"] = ax.get_title()
        leg = ax.get_legend()
        seen["legend"] = [] if leg is None else [t.get_text() for t in leg.get_texts()]
        seen["xmax"] = ax.get_xlim()[1]
        save(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    png = tmp_path / "t.png"
    timeline_png(user_traces(load_dir(trace_dir)), str(png), "trace")
    assert png.stat().st_size > 1000
    assert seen["yticks"], seen
    assert all("allreduce" in t for t in seen["yticks"]), seen["yticks"]
    assert "(ms)" in seen["xlabel"], seen
    assert seen["xmax"] < 60_000, seen  # ms: a sub-second run, not µs in the 100,000s
    assert "allreduce" in seen["title"], seen
    assert {"send", "recv", "execution"} <= set(seen["legend"]), seen
    assert "message (send to receive)" in seen["legend"], seen


@pytest.mark.timeout(60)
def test_html_timeline_has_a_colour_legend(trace_dir: Path) -> None:
    page = timeline_page(user_traces(load_dir(trace_dir)), "trace")
    legend = page[page.index('id="legend"'):]
    for what in ("send", "recv", "execution", "message from a send to its matching receive"):
        assert what in legend, what
    assert "background:#" in legend
