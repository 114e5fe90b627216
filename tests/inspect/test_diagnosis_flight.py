"""The flight recorder: after a timeout each waiting rank's trace holds its last collectives,
the failing one among them with what it waits for; ``asynccoll inspect flight`` prints them."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from asynccoll import CollectiveTimeoutError, Quorum
from asynccoll.cli import main
from asynccoll.inspect.tracefile import load_dir
from asynccoll.testing import local_world


@pytest.mark.timeout(30)
async def test_the_dump_after_a_timeout_holds_the_failing_collective(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.ones(4)
    async with local_world(2, trace=str(tmp_path)) as comms:
        h = [c.partial_allreduce(Quorum(2), like=x, name="q") for c in comms]
        for _ in range(3):
            await asyncio.gather(*(c.allreduce(x) for c in comms))
        with pytest.raises(CollectiveTimeoutError):
            await h[0](x, timeout=0.3)  # rank 1 never arrives
        await comms[0].close(timeout=0)
        await comms[1].close(timeout=0)
    rt = load_dir(tmp_path)[0]
    assert rt.flights, "no flight record after the timeout"
    rec = rt.flights[-1]
    assert rec["reason"].startswith("timeout: rank 0: quorum allreduce 'q' execution 0")
    entries = rec["entries"]
    assert [e["name"] for e in entries if e["state"] == "completed"].count("allreduce") >= 3
    (failing,) = [e for e in entries if e["state"] != "completed"]
    assert failing["name"] == "partial_allreduce.quorum"
    assert failing["execution"] == 0
    assert failing["state"] == "called"
    assert "quorum 1 of 2 arrived (needs 2): missing [1]" in failing["waiting"]
    assert "absent rank(s) [1]" in failing["waiting"]
    assert entries[-1] is failing or entries[-1]["state"] == "completed"
    assert main(["inspect", "flight", str(tmp_path), "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "flight recorder of rank 0" in out
    assert "partial_allreduce.quorum" in out
    assert "#0 called" in out


@pytest.mark.timeout(30)
async def test_without_a_trace_the_timeout_logs_the_flight_record(
        caplog: pytest.LogCaptureFixture) -> None:
    x = np.ones(4)
    async with local_world(2) as comms:
        with caplog.at_level(logging.WARNING, logger="asynccoll.comm"), \
                pytest.raises(CollectiveTimeoutError):
            await comms[0].allreduce(x, timeout=0.2)
        await comms[0].close(timeout=0)
        await comms[1].close(timeout=0)
    (msg,) = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert "flight recorder of rank 0" in msg
    assert "waiting for rank(s) [1]" in msg


@pytest.mark.timeout(30)
async def test_a_lost_rank_leaves_a_flight_record(tmp_path: Path) -> None:
    x = np.ones(4)
    async with local_world(3, trace=str(tmp_path)) as comms:
        await asyncio.gather(*(c.allreduce(x) for c in comms))
        await comms[2].close(timeout=0)  # no goodbye: a loss to the others
        for _ in range(100):
            if comms[0].lost is not None and comms[1].lost is not None:
                break
            await asyncio.sleep(0.02)
        for c in comms[:2]:
            await c.close(timeout=0)
    for r in (0, 1):
        (rec,) = [f for f in load_dir(tmp_path)[r].flights if "lost" in f["reason"]]
        assert rec["reason"].startswith("rank 2 lost")
        assert any(e["name"] == "allreduce" and e["state"] == "completed"
                   for e in rec["entries"])


@pytest.mark.timeout(30)
async def test_leaving_on_an_error_leaves_a_flight_record(tmp_path: Path) -> None:
    x = np.ones(4)

    async def rank(c: object, r: int) -> None:
        async with c:  # type: ignore[attr-defined]
            await c.allreduce(x)  # type: ignore[attr-defined]
            if r == 0:
                raise KeyError("the application failed")
            await asyncio.sleep(0.5)

    async with local_world(2, trace=str(tmp_path)) as comms:
        got = await asyncio.gather(*(rank(c, r) for r, c in enumerate(comms)),
                                   return_exceptions=True)
    assert isinstance(got[0], KeyError)
    rt = load_dir(tmp_path)[0]
    assert rt.flights, "no flight record when leaving on an error"
    rec = rt.flights[-1]
    assert rec["reason"].startswith("exit after KeyError")
    assert any(e["name"] == "allreduce" and e["state"] == "completed" for e in rec["entries"])
