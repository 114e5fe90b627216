"""Calls cancelled at any moment (short ``asyncio.wait_for`` timeouts) lose no contribution and
hand out no result twice: with ``Accumulate.SUM`` every rank ends with the sum of exactly
every deposit, whether a call was cancelled before its data went in, while it waited, or
after its result was taken but before its caller resumed (issue: latency; the result goes
back to the handle and the next call or the flush hands it out)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from asynccoll import Accumulate
from asynccoll.comm import partial as partial_mod
from asynccoll.errors import BusyError
from asynccoll.testing import local_world, policy_of

N = 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "quorum"), [("solo", None), ("majority", None),
                                              ("quorum", 2)])
async def test_cancelled_calls_keep_every_contribution(
        kind: str, quorum: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    deposits = [0]
    real_add = partial_mod.PartialAllreduce._add

    def counted(self: Any, *args: Any, **kw: Any) -> None:
        deposits[0] += 1
        real_add(self, *args, **kw)

    monkeypatch.setattr(partial_mod.PartialAllreduce, "_add", counted)
    P = 4
    async with local_world(P, "tcp", timeout=30) as comms:
        hs = [c.partial_allreduce(policy_of(kind, quorum), like=np.zeros(N),
                                  accumulate=Accumulate.SUM)
              for c in comms]
        got = [np.zeros(N) for _ in range(P)]
        cancelled = [0]
        stop = asyncio.Event()

        async def caller(r: int) -> None:
            rng = random.Random(r)
            while not stop.is_set():
                try:
                    res = await asyncio.wait_for(hs[r](np.ones(N)), rng.uniform(0.0003, 0.004))
                    got[r] += res.value
                except asyncio.TimeoutError:
                    cancelled[0] += 1
                except BusyError:  # the cancelled call ahead is still being unwound
                    await asyncio.sleep(0.001)

        tasks = [asyncio.ensure_future(caller(r)) for r in range(P)]
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.2)  # results of the last cancelled calls go back
        flushed = await asyncio.wait_for(asyncio.gather(*(h.flush() for h in hs)), 30)
        for r in range(P):
            got[r] += flushed[r].value
    assert cancelled[0] > 0
    for r in range(P):
        assert np.array_equal(got[r], np.full(N, float(deposits[0]))), (r, got[r][0], deposits)
