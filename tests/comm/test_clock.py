"""Clock offsets estimated at connect: ranks whose clocks are seconds apart (as on hosts
without clock synchronisation) still see arrival times that compare, in results and traces.

Real processes over loopback tcp; ranks 1 and 2 run wall clocks shifted by +2 s and -1.5 s
(their ``time.time`` is patched before they connect).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Majority
from asynccoll.comm.clock import estimate_offset
from asynccoll.inspect.stragglers import stragglers
from asynccoll.inspect.tracefile import load_dir
from asynccoll.testing import inproc_world

SKEW = {0: 0.0, 1: 2.0, 2: -1.5}


async def _rank(rank: int, P: int, port: int, trace: str) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60, trace=trace)
    arrivals: list[dict[int, float]] = []
    async with comm:
        h = comm.partial_allreduce(Majority(), like=np.ones(4))
        for _ in range(6):
            await comm.barrier()  # every rank calls at about the same (true) time
            res = await h(np.ones(4))
            if len(res.arrivals) > 1:
                arrivals.append(res.arrivals)
        await h.flush()
        return {"offset": comm.clock_offset, "arrivals": arrivals}


def _child(rank: int, P: int, *rest: Any) -> None:
    import time

    real, skew = time.time, SKEW[rank]
    time.time = lambda: real() + skew  # this process's wall clock, as on another host
    async_child(rank, P, _rank, *rest)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_skewed_clocks_are_corrected(tmp_path: Path) -> None:
    out = spawn_world(_child, 3, (free_port(), str(tmp_path)))
    for r, o in enumerate(out):
        assert abs(o["offset"] + SKEW[r]) < 0.05, (r, o["offset"])
        assert o["arrivals"], "no execution had two arrivals"
        for arr in o["arrivals"]:
            # uncorrected, the ranks would arrive seconds apart
            assert max(arr.values()) < 0.5, arr
    # the trace records each rank's offset, and the straggler report applies it: the
    # executors' start times (each rank's skewed clock) compare
    traces = load_dir(tmp_path)
    assert {r: round(t.clock_offset, 1) for r, t in traces.items()} == \
        {r: round(-s, 1) for r, s in SKEW.items()}
    # (the barrier: every rank starts its executions itself)
    reps = [rep for rep in stragglers(traces) if rep.name == "barrier"]
    assert reps, [rep.name for rep in stragglers(traces)]
    for rl in reps[0].ranks.values():
        assert rl.lateness_ms, rl.rank
        assert max(rl.lateness_ms) < 500, (rl.rank, rl.lateness_ms)


@pytest.mark.timeout(30)
async def test_one_host_offsets_are_near_zero_and_rounds_are_checked() -> None:
    async with inproc_world(3) as ts:
        offs = await asyncio.gather(*(estimate_offset(t, 4) for t in ts))
        assert offs[0] == 0.0
        assert all(abs(o) < 0.01 for o in offs)
        with pytest.raises(ValueError, match="rounds"):
            await estimate_offset(ts[0], 0)
