"""Calls of one collective run in the order they were made on each rank.

A rank may start a second call of a collective before its first returns (OD-SGD keeps one
allreduce in flight while it computes the next gradient). The first use of a collective
agrees on its definition with the other ranks before it executes; a second call made during
that agreement must queue behind the first, not overtake it: otherwise its execution pairs
with the other ranks' first call and every rank gets a sum of mixed calls (found as replicas
that differed after an odsgd run, about one CI run in three).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccoll import CollectiveTimeoutError
from asynccoll.testing import local_world

P = 3


def values(rank: int, call: int, n: int) -> np.ndarray:
    return np.full(n, float(10 * call + rank + 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("n", [4, 1 << 16], ids=["small", "large"])  # copied / bound buffers
async def test_a_second_call_made_during_the_first_use_does_not_overtake_it(
        transport: str, n: int) -> None:
    async with local_world(P, transport, timeout=10) as comms:
        async def rank(r: int) -> list[np.ndarray]:
            comm = comms[r]
            if r == 0:  # both calls at once: the second is made while the first agrees
                return list(await asyncio.gather(comm.allreduce(values(r, 0, n)),
                                                 comm.allreduce(values(r, 1, n))))
            # one after the other
            return [await comm.allreduce(values(r, 0, n)), await comm.allreduce(values(r, 1, n))]

        got = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 20)
    for c in range(2):
        want = sum(values(r, c, n) for r in range(P))
        for r in range(P):
            np.testing.assert_array_equal(got[r][c], want, err_msg=f"rank {r}, call {c}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_call_queued_behind_a_failed_one_runs_on_a_fresh_executor(transport: str) -> None:
    """A call queued behind one that times out does not run on the dropped executor (it
    failed with "executor closed"): it starts a fresh one, which waits for the peers and
    times out by its own deadline with the error that names what it waited for."""
    async with local_world(2, transport, timeout=10) as comms:
        first = asyncio.ensure_future(comms[0].allreduce(np.ones(8), timeout=0.3))
        second = asyncio.ensure_future(comms[0].allreduce(np.ones(8), timeout=0.6))
        for call in (first, second):
            with pytest.raises(CollectiveTimeoutError, match="rank"):
                await asyncio.wait_for(call, 10)


@pytest.mark.timeout(30)
async def test_sparse_calls_keep_their_order_through_the_first_use() -> None:
    n = 64
    async with local_world(P, "tcp", timeout=10) as comms:
        async def rank(r: int) -> list[np.ndarray]:
            comm = comms[r]
            if r == 0:
                return list(await asyncio.gather(comm.sparse_allreduce(values(r, 0, n)),
                                                 comm.sparse_allreduce(values(r, 1, n))))
            return [await comm.sparse_allreduce(values(r, 0, n)),
                    await comm.sparse_allreduce(values(r, 1, n))]

        got = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 20)
    for c in range(2):
        want = sum(values(r, c, n) for r in range(P))
        for r in range(P):
            np.testing.assert_array_equal(np.asarray(got[r][c]), want,
                                          err_msg=f"rank {r}, call {c}")
