"""Stall warnings: a collective that waits says so, naming the ranks it waits for, at growing
intervals, before its timeout; then the timeout names the same."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from asynccoll import CollectiveTimeoutError, Quorum
from asynccoll.testing import local_world


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["allreduce", "majority"])
async def test_a_stalled_collective_warns_at_growing_intervals_then_times_out(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    async with local_world(2, stall_warn=0.1) as comms:
        x = np.ones(4)
        if kind == "allreduce":
            call = comms[0].allreduce(x, timeout=1.0)  # rank 1 never calls
        else:
            h = comms[0].partial_allreduce(Quorum(2), like=x, name="q")
            comms[1].partial_allreduce(Quorum(2), like=x, name="q")
            call = h(x, timeout=1.0)
        with caplog.at_level(logging.WARNING, logger="asynccoll.comm"), \
                pytest.raises(CollectiveTimeoutError, match="rank 1"):
            await call
        stalls = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        # at 0.1, 0.3 and 0.7 s: doubling intervals, not one line per poll
        assert 2 <= len(stalls) <= 4, stalls
        assert all(s.startswith("rank 0: ") and "rank 1" in s for s in stalls), stalls
