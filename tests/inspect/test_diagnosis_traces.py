"""Traces people can open: solo "initiators" are the ranks that started an execution (not the
ranks allowed to); Perfetto JSON of a Communicator run (64-bit schedule ids) has small unique
thread ids, one track per rank and op lane; the HTML timeline fits the whole run on open."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asynccoll import Solo
from asynccoll.inspect.html import timeline_html
from asynccoll.inspect.perfetto import perfetto_json
from asynccoll.inspect.summary import summarize
from asynccoll.inspect.tracefile import load_dir
from asynccoll.testing import local_world

CHROMIUM = Path("/usr/bin/chromium")


async def _solo_run(tmp: Path, steps: int) -> None:
    """Only rank 2 calls a solo allreduce: it starts every execution, the others are
    activated from outside."""
    async with local_world(4, trace=str(tmp), timeout=10) as comms:
        x = np.ones(4, np.float32)
        hs = [c.partial_allreduce(Solo(), like=x, name="s") for c in comms]
        for _ in range(steps):
            await hs[2](x)
        await asyncio.gather(*(h.flush() for h in hs))


@pytest.mark.timeout(30)
async def test_solo_initiators_are_who_started(tmp_path: Path) -> None:
    await _solo_run(tmp_path, 5)
    (summ,) = [s for s in summarize(load_dir(tmp_path)) if "solo" in s.name]
    plain = [d for d in summ.executions if not any(x.get("flushed") for x in d.extra.values())]
    assert len(plain) == 5
    assert all(d.initiators == [2] for d in plain), [d.initiators for d in plain]
    assert all(d.allowed == [0, 1, 2, 3] for d in plain)  # S(e) of solo: everyone may
    assert summ.initiators - Counter({2: 5}) == Counter(
        r for d in summ.executions if d not in plain for r in d.initiators)


@pytest.mark.timeout(30)
async def test_perfetto_thread_ids_are_small_and_unique_per_rank_and_track(
        tmp_path: Path) -> None:
    await _solo_run(tmp_path, 3)
    doc = json.loads(perfetto_json(load_dir(tmp_path)))
    evs = doc["traceEvents"]
    assert max(int(s) for s in doc["otherData"]["sched_ids"].values()) >= 2 ** 62  # 64-bit ids
    names: dict[tuple[int, int], str] = {}
    for ev in evs:
        assert 0 <= ev["tid"] < 2 ** 31, ev
        assert 0 <= ev["pid"] < 2 ** 31, ev
        if ev["ph"] == "M" and ev["name"] == "thread_name":
            assert names.setdefault((ev["pid"], ev["tid"]), ev["args"]["name"]) \
                == ev["args"]["name"]
    # one track per (rank, collective, lane); the same lane has the same id on every rank
    per_rank: dict[int, dict[str, int]] = {}
    for (pid, tid), name in names.items():
        assert name not in per_rank.setdefault(pid, {}), (pid, name)
        per_rank[pid][name] = tid
    assert len(per_rank) == 4
    tables = [{n: t for n, t in d.items()} for d in per_rank.values()]
    for t in tables:
        for n, tid in t.items():
            assert all(o.get(n, tid) == tid for o in tables)
    # ids survive a reader that takes JSON numbers as doubles (no two collapse)
    tracks = {(ev["pid"], float(ev["tid"])) for ev in evs if ev["ph"] == "X"}
    assert len(tracks) == len({(ev["pid"], ev["tid"]) for ev in evs if ev["ph"] == "X"})


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless check needs /usr/bin/chromium")
def test_timeline_fits_the_whole_run_on_open(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot", reason="reading the PNG needs matplotlib")
    # a run that starts late (62 ms after the first arming) and lasts seconds: both its first
    # and its last slice must be on screen when the page opens
    slices = [{"row": 0, "ts": 62_000.0, "dur": 40_000.0, "name": "first", "color": "#ff0000",
               "fields": {}},
              {"row": 1, "ts": 4_900_000.0, "dur": 60_000.0, "name": "last",
               "color": "#0000ff", "fields": {}}]
    page = tmp_path / "tl.html"
    page.write_text(timeline_html("fit", ["r0", "r1"], slices, [], 4_960_000.0))
    shot = tmp_path / "tl.png"
    r = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars",
                        "--window-size=1400,900", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=90, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    img = plt.imread(str(shot))[..., :3] * 255.0
    red = (np.abs(img - [255, 0, 0]).sum(axis=-1) < 40).sum()
    blue = (np.abs(img - [0, 0, 255]).sum(axis=-1) < 40).sum()
    assert red > 20, "the first slice is not on screen"
    assert blue > 20, "the last slice is not on screen"
