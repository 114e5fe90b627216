"""The ``combine`` hook of the partial allreduce (used by RNA and BackupSGD)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from asynccoll import Solo
from asynccoll.testing import local_world


@pytest.mark.timeout(30)
async def test_combine_sees_late_calls_and_controls_the_send_buffer() -> None:
    async with local_world(2, progress="inline", timeout=10) as comms:
        hs = [c.partial_allreduce(Solo(), like=np.zeros(3), name="hook") for c in comms]
        seen: list[tuple[int, bool]] = []

        def drop_late(acc: Any, x: Any, n: int, late: bool) -> int:
            seen.append((n, late))
            if late:
                return n
            acc[...] = 10 * x
            return 1

        # Rank 0 alone: rank 1 contributes nothing to round 0.
        r0 = await asyncio.wait_for(hs[0](np.ones(3)), 5)
        assert r0.round == 0
        assert r0.contributors == {0}
        # Rank 1 is late for round 0: the hook is told so and drops its data.
        r1 = await asyncio.wait_for(hs[1](np.full(3, 2.0), combine=drop_late), 5)
        assert (r1.round, r1.included) == (0, False)
        assert seen == [(0, True)]
        # Next round: rank 1's 2s were not carried; its hook-written buffer (10 * 3) is summed.
        a, b = await asyncio.wait_for(asyncio.gather(
            hs[0](np.ones(3)), hs[1](np.full(3, 3.0), combine=drop_late)), 5)
        assert seen == [(0, True), (0, False)]
        for r in (a, b):
            assert r.round == 1
            assert r.included
            assert r.count == 2
            np.testing.assert_array_equal(r.value, np.full(3, 31.0))
