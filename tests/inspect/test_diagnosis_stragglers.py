"""The straggler report: an injected straggler (rank 2 sleeps 50 ms before each step) is ranked
last, with its lateness right within 10 ms; ``inspect trace DIR --stragglers`` prints and plots."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from asynccoll import Solo
from asynccoll.cli import main
from asynccoll.inspect.stragglers import stragglers
from asynccoll.inspect.tracefile import load_dir
from asynccoll.testing import local_world

STEPS, LATE = 10, 0.050


async def _run(tmp: Path) -> None:
    async with local_world(4, trace=str(tmp), timeout=20) as comms:
        x = np.ones(256, np.float32)

        async def worker(r: int) -> None:
            for _ in range(STEPS):
                if r == 2:
                    await asyncio.sleep(LATE)
                await comms[r].allreduce(x)

        await asyncio.gather(*(worker(r) for r in range(4)))


@pytest.mark.timeout(60)
async def test_an_injected_straggler_is_ranked_last_with_its_lateness(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _run(tmp_path)
    reps = [r for r in stragglers(load_dir(tmp_path)) if r.name == "allreduce"]
    (rep,) = reps
    assert rep.executions == STEPS
    assert rep.ranking()[0] == 2
    late = rep.ranks[2]
    assert late.last >= STEPS - 1, late
    assert abs(late.pct()["p50"] - LATE * 1e3) < 10, late.lateness_ms
    for r in (0, 1, 3):
        assert rep.ranks[r].pct()["p50"] < 10, rep.ranks[r].lateness_ms
    png = tmp_path / "late.png"
    args = ["inspect", "trace", str(tmp_path), "--stragglers"]
    pytest.importorskip("matplotlib")
    assert main([*args, str(png)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("│ 2 ")
               or line.strip().startswith("│    2"))
    assert "10/10" in row, out
    assert png.stat().st_size > 1000


async def _run_solo(tmp: Path, steps: int = 12) -> None:
    """A 4-rank solo handle whose rank 2 sleeps LATE before each call: the others never wait
    for it, so it never arrives before an execution is under way."""
    async with local_world(4, trace=str(tmp), timeout=20) as comms:
        x = np.ones(256, np.float32)
        hs = [c.partial_allreduce(Solo(), like=x) for c in comms]

        async def worker(r: int) -> None:
            for _ in range(steps):
                await asyncio.sleep(LATE if r == 2 else 0.002)
                await hs[r](x)
            await hs[r].flush()

        await asyncio.gather(*(worker(r) for r in range(4)))


@pytest.mark.timeout(60)
async def test_a_rank_that_never_arrives_in_time_is_ranked_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _run_solo(tmp_path)
    (rep,) = [r for r in stragglers(load_dir(tmp_path)) if r.name == "solo_allreduce"]
    late = rep.ranks[2]
    assert rep.ranking()[0] == 2, [(r, rep.ranks[r].missed) for r in rep.ranking()]
    assert late.missed > late.arrived
    assert late.missed_bound() is not None
    # flush executions have no arrivals to compare: left out, and the report says so
    assert rep.flushed > 0
    assert rep.executions == rep.recorded - rep.flushed
    assert main(["inspect", "trace", str(tmp_path), "--stragglers"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert rows[0].split("│")[1].strip() == "2", out
    for said in (f"of {rep.recorded} executions", "flush execution", "in time:", "lower bound"):
        assert said in out, out
