"""ucx: a new process takes a lost rank's place (``Transport.rejoin``, ``admit_rejoins``), as
tests/transport/test_tcp_rejoin.py for tcp.

Real UCX endpoints on 127.0.0.1; the ranks are transports of one process, so that the test can
close one (its peers see its endpoints close, as when a process dies) and start another in its
place. The process-level cases (SIGKILL, ``asynccoll run --max-restarts``) are in
tests/adversarial/test_rejoin.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest
from _rejoin_helpers import lose, ping

from asynccoll.errors import PeerLostError
from asynccoll.transport.frames import Kind

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                 reason="ucxx is not installed (pip install 'asynccoll[ucx]')")]

SECRET = b"u" * 32
SCHED = 9


async def _world(n: int) -> tuple[list[Any], dict[int, str]]:
    from asynccoll.transport.ucx import UcxTransport

    ts = [UcxTransport(r, n, secret=SECRET) for r in range(n)]
    addrs = {t.rank: await t.listen("ucx://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    return ts, addrs


@pytest.mark.parametrize("victim", [1, 0, 2])
async def test_a_new_process_takes_a_lost_ranks_place_when_rejoins_are_admitted(
        victim: int) -> None:
    from asynccoll.transport.ucx import UcxTransport

    ts, addrs = await _world(3)
    try:
        for t in ts:
            t.admit_rejoins = True
        joined: list[tuple[int, int]] = []
        for t in ts:
            t.on_peer_joined(lambda r, me=t.rank: joined.append((me, r)))
        await lose(ts, victim)
        new = UcxTransport(victim, 3, secret=SECRET)
        new.incarnation = 2  # its restart 2: every member learns it in the handshake
        await new.listen("ucx://127.0.0.1:0")
        others = [r for r in range(3) if r != victim]
        reached = await new.rejoin({r: addrs[r] for r in others}, timeout=10)
        assert reached == others  # the lower ranks took a dial from above too
        await asyncio.sleep(0.1)
        assert sorted(joined) == [(r, victim) for r in others]
        assert [ts[r].incarnation_of(victim) for r in others] == [2, 2]
        assert [new.incarnation_of(r) for r in others] == [0, 0]
        ts[victim] = new
        for r in others:  # frames both ways with the new process
            want_in = (np.arange(4, dtype=np.int64) + 100 * r + 3).tobytes()
            assert await ping(ts[r], new, 3, SCHED) == want_in
            want_out = (np.arange(4, dtype=np.int64) + 100 * victim + 4).tobytes()
            assert await ping(new, ts[r], 4, SCHED) == want_out
        # and the members among themselves, untouched
        a, b = others
        assert await ping(ts[a], ts[b], 5, SCHED) == (np.arange(4, dtype=np.int64) + 100 * a + 5
                                                ).tobytes()
    finally:
        for t in ts:
            await t.close()


async def test_a_lost_rank_stays_lost_unless_rejoins_are_admitted() -> None:
    from asynccoll.transport.ucx import UcxTransport

    ts, addrs = await _world(3)
    try:
        await lose(ts, 1)  # admit_rejoins is off: nobody takes the new process
        new = UcxTransport(1, 3, secret=SECRET)
        await new.listen("ucx://127.0.0.1:0")
        with pytest.raises(PeerLostError, match="admitted this one"):
            await new.rejoin({0: addrs[0], 2: addrs[2]}, timeout=2)
        await new.close()
        fut = ts[0].post_frame(1, int(Kind.DATA), SCHED, 0, 0, memoryview(b"x"))
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(fut, 5)
    finally:
        for t in ts:
            await t.close()


async def test_a_stranger_cannot_take_a_lost_ranks_place() -> None:
    from asynccoll.transport.ucx import UcxTransport

    ts, addrs = await _world(3)
    try:
        for t in ts:
            t.admit_rejoins = True
        await lose(ts, 2)
        stranger = UcxTransport(2, 3, secret=b"s" * 32)  # not the job's secret
        await stranger.listen("ucx://127.0.0.1:0")
        with pytest.raises(PeerLostError):
            await stranger.rejoin({0: addrs[0], 1: addrs[1]}, timeout=2)
        await stranger.close()
        assert not ts[0].may_rejoin(1)  # a live peer's place is never taken
        assert ts[0].may_rejoin(2)  # still open to the job's own restart
    finally:
        for t in ts:
            await t.close()
