"""asynccoll.connect() in real processes: synchronous and partial collectives over tcp and ucx."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate
from asynccoll.testing import policy_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HAVE_UCX = importlib.util.find_spec("ucxx") is not None


async def rank_main(rank: int, P: int, port: int, transport: str) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport=transport, timeout=60)
    async with comm:
        x = np.arange(10, dtype=np.float64) * (rank + 1)
        s = await comm.allreduce(x, timeout=30)
        assert np.array_equal(s, np.arange(10) * P * (P + 1) / 2), s
        b = await comm.broadcast(x, root=P - 1, timeout=30)
        assert np.array_equal(b, np.arange(10) * P)
        out: dict[str, Any] = {"rank": comm.rank, "size": comm.size}
        for kind, q in (("solo", None), ("majority", None), ("quorum", max(1, P - 1))):
            h = comm.partial_allreduce(policy_of(kind, q), like=x, accumulate=Accumulate.SUM)
            got = np.zeros_like(x)
            count = 0
            for _ in range(6):
                await asyncio.sleep(0.002 * rank)  # linear skew
                r = await h(x, timeout=30)
                got += r.value
                count += r.count
            f = await h.flush(timeout=30)
            got += f.value
            count += f.count
            # every contribution of every rank counted exactly once, as seen by this rank
            assert np.array_equal(got, 6 * np.arange(10) * P * (P + 1) / 2), (kind, got)
            assert count == 6 * P
        await comm.barrier(timeout=30)
        # A peer's frames that wait unread when it closes are dropped with it (the matcher
        # fails receives of a lost peer before looking at held frames): let peers read ours.
        await asyncio.sleep(0.2)
        out["transport"] = type(comm.transport).__name__
    return out


def run_world(P: int, transport: str, timeout: float = 90.0) -> list[dict[str, Any]]:
    return spawn_world(async_child, P, (rank_main, free_port(), transport), timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_tcp_processes(P: int) -> None:
    out = run_world(P, "tcp")
    assert [o["rank"] for o in out] == list(range(P))
    assert all(o["size"] == P and o["transport"] == "TcpTransport" for o in out)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_UCX, reason="ucxx is not installed (pip install 'asynccoll[ucx]')")
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ucx_processes(P: int) -> None:
    out = run_world(P, "ucx")
    assert all(o["transport"] == "UcxTransport" for o in out)
