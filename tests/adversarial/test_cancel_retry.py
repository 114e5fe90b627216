"""A call cancelled while it waits (``asyncio.wait_for`` timing out) and retried at once: the
retry proceeds (it waits for the cancelled call to unwind instead of raising ``BusyError``), and
every contribution, the cancelled call's included, is counted exactly once.

Before, on a majority or quorum handle of three ranks, the retry raised ``BusyError: ...
already has a call or flush under way`` (3 of 3 runs), and under quorum every rank's final
flush then timed out. Every kind, over inproc and tcp, progress threads as ``connect()`` makes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccoll import Accumulate, Deadline, Majority, Quorum, Solo, TwoChoice
from asynccoll.testing import local_world

KINDS = [Solo(), Majority(), TwoChoice(), Quorum(3), Deadline(bounds=5.0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_cancelled_call_and_an_immediate_retry(transport: str) -> None:
    P = 3
    async with local_world(P, transport, timeout=30) as comms:
        for policy in KINDS:
            kind = policy.name
            hs = [c.partial_allreduce(policy, like=np.zeros(4), accumulate=Accumulate.SUM,
                                      name=kind) for c in comms]
            xs = [np.full(4, 1000.0 ** r) for r in range(P)]
            got = [np.zeros(4) for _ in range(P)]
            try:  # rank 0 alone: the others are not calling, so it waits (but under solo)
                got[0] += (await asyncio.wait_for(hs[0](xs[0]), 0.05)).value
            except asyncio.TimeoutError:
                pass
            # the retry at once, the others with it
            res = await asyncio.wait_for(
                asyncio.gather(*(h(x) for h, x in zip(hs, xs, strict=True))), 30)
            for r in range(P):
                got[r] += res[r].value
            fl = await asyncio.wait_for(asyncio.gather(*(h.flush(timeout=20) for h in hs)), 30)
            want = 2 * xs[0] + xs[1] + xs[2]  # rank 0's cancelled call counted once
            for r in range(P):
                got[r] += fl[r].value
                assert np.array_equal(got[r], want), (kind, r, got[r], want)


@pytest.mark.timeout(60)
async def test_averaging_by_contributions_divides() -> None:
    # accumulate="mean" (op="avg" with accumulate) divides each execution's sum by its count
    # as torch's averaging does (x / 3 is rounded once; x * (1 / 3) twice and differs by an
    # ulp for some x): the values are picked so that it shows
    P = 3
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(4096).astype(np.float32) for _ in range(P)]
    total = xs[0] + xs[1] + xs[2]  # the order the allreduce sums in at P = 3 is not asked:
    assert np.any(total / np.float32(3) != total * np.float32(1 / 3))  # the case exists
    async with local_world(P, "inproc", timeout=30) as comms:
        hs = [c.partial_allreduce(Quorum(P), like=np.zeros(4096, np.float32), op="avg",
                                  accumulate=Accumulate.SUM) for c in comms]
        res = await asyncio.wait_for(
            asyncio.gather(*(h(x) for h, x in zip(hs, xs, strict=True))), 30)
        sums = await asyncio.wait_for(asyncio.gather(*(
            c.allreduce(x) for c, x in zip(comms, xs, strict=True))), 30)
    for r in range(P):
        assert res[r].count == P
        assert np.array_equal(res[r].value, sums[r] / np.float32(P))  # one rounding
        assert np.array_equal(res[r].value.view(np.uint32), res[0].value.view(np.uint32))
