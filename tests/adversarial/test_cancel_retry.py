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

from asynccoll.testing import local_world

KINDS = [("solo", {}), ("majority", {}), ("two_choice", {}), ("quorum", {"quorum": 3}),
         ("deadline", {"deadline": 5.0})]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_cancelled_call_and_an_immediate_retry(transport: str) -> None:
    P = 3
    async with local_world(P, transport, timeout=30) as comms:
        for kind, kw in KINDS:
            hs = [c.partial_allreduce(kind, like=np.zeros(4), accumulate=True, name=kind, **kw)
                  for c in comms]
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
