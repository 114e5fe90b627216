"""tcp: a new process takes a lost rank's place (``Transport.rejoin``, ``admit_rejoins``).

Real sockets on 127.0.0.1; the ranks are transports of one process, so that the test can close
one (its peers see the connection end, as when a process dies) and start another in its place.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _rejoin_helpers import lose, ping

from asynccoll.errors import PeerLostError, TransportError
from asynccoll.transport.frames import Kind
from asynccoll.transport.inproc import InprocTransport
from asynccoll.transport.tcp import TcpTransport

SECRET = b"r" * 32
SCHED = 5

pytestmark = pytest.mark.timeout(60)


async def _world(n: int) -> tuple[list[TcpTransport], dict[int, str]]:
    ts = [TcpTransport(r, n, secret=SECRET) for r in range(n)]
    addrs = {t.rank: await t.listen("tcp://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    return ts, addrs


async def test_a_new_process_takes_a_lost_ranks_place_when_rejoins_are_admitted() -> None:
    ts, addrs = await _world(4)
    try:
        for t in ts:
            t.admit_rejoins = True
        joined: list[tuple[int, int]] = []
        for t in ts:
            t.on_peer_joined(lambda r, me=t.rank: joined.append((me, r)))
        # a frame of the old rank 2 held at rank 0, never received: it must not reach the new
        # process's receive of the same key
        ts[2].post_frame(0, int(Kind.DATA), SCHED, 7, 0, memoryview(b"old!"))
        await asyncio.sleep(0.2)
        assert ts[0].matcher.held_count == 1
        assert await lose(ts, 2) == [2, 2, 2]
        new = TcpTransport(2, 4, secret=SECRET)
        await new.listen("tcp://127.0.0.1:0")
        reached = await new.rejoin({r: a for r, a in addrs.items() if r != 2}, timeout=10)
        assert reached == [0, 1, 3]
        await asyncio.sleep(0.1)
        assert sorted(joined) == [(0, 2), (1, 2), (3, 2)]
        assert ts[0].matcher.held_count == 0  # the old process's frame is gone
        ts[2] = new
        for a in ts:  # every pair talks, both ways, the new process included
            for b in ts:
                if a is not b:
                    want = (np.arange(4, dtype=np.int64) + 100 * a.rank + 7).tobytes()
                    assert await ping(a, b, 7, SCHED) == want
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_a_lost_rank_stays_lost_unless_rejoins_are_admitted() -> None:
    ts, addrs = await _world(3)
    try:
        await lose(ts, 1)
        new = TcpTransport(1, 3, secret=SECRET)
        await new.listen("tcp://127.0.0.1:0")
        with pytest.raises(PeerLostError, match="no rank of the job admitted this one"):
            await new.rejoin({r: a for r, a in addrs.items() if r != 1}, timeout=1.5)
        await new.close()
        assert ts[0].stats.reasons
        assert "does not admit restarted ranks" in ts[0].stats.reasons[-1]
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_a_rank_nobody_listens_for_is_lost_at_once_to_the_joiner() -> None:
    ts, addrs = await _world(3)
    try:
        for t in ts:
            t.admit_rejoins = True
        await lose(ts, 1)
        await ts[2].close()  # rank 2 is gone too: nothing listens at its address
        new = TcpTransport(1, 3, secret=SECRET)
        await new.listen("tcp://127.0.0.1:0")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await new.rejoin({0: addrs[0], 2: addrs[2]}, timeout=20) == [0]
        assert loop.time() - t0 < 5  # refused, not waited out
        assert new.matcher.is_lost(2)
        ts[1] = new
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_a_stranger_cannot_take_a_lost_ranks_place() -> None:
    ts, addrs = await _world(3)
    try:
        for t in ts:
            t.admit_rejoins = True
        await lose(ts, 2)
        stranger = TcpTransport(2, 3, secret=b"x" * 32)
        await stranger.listen("tcp://127.0.0.1:0")
        with pytest.raises(PeerLostError):
            await stranger.rejoin({0: addrs[0], 1: addrs[1]}, timeout=1.5)
        await stranger.close()
        assert all(t.matcher.is_lost(2) for t in ts[:2])  # still lost: nobody was admitted
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_rejoin_is_refused_by_a_transport_that_cannot() -> None:
    t = InprocTransport(0, 2)
    with pytest.raises(TransportError, match="cannot rejoin"):
        await t.rejoin({1: "inproc://x/1"}, timeout=1)


async def test_a_frame_sent_when_a_peer_joins_does_not_break_its_handshake() -> None:
    # A member whose join listener sends at once (a restarted rank that waits to be taken
    # back says "ready" to every rank that comes back after it): the frame must follow the
    # handshake's last message, or the dialer reads it as a refusal and the member sees the
    # new process lost (and tells the others so) while it lives.
    ts, addrs = await _world(3)
    try:
        for t in ts:
            t.admit_rejoins = True
        await lose(ts, 0)
        greeted: list[int] = []

        def greet(rank: int) -> None:
            greeted.append(rank)
            ts[2].post_frame(rank, int(Kind.DATA), SCHED, 3, 0, memoryview(b"hi!!"))

        ts[2].on_peer_joined(greet)
        lost: list[int] = []
        for t in ts[1:]:
            t.on_peer_lost(lambda r, exc: lost.append(r))
        new = TcpTransport(0, 3, secret=SECRET)
        await new.listen("tcp://127.0.0.1:0")
        got = new.post_recv(2, SCHED, 3, 0)
        assert await new.rejoin({1: addrs[1], 2: addrs[2]}, timeout=5) == [1, 2]
        assert bytes((await asyncio.wait_for(got, 5)).payload) == b"hi!!"
        await asyncio.sleep(0.1)
        assert greeted == [0]  # one handshake, accepted the first time
        assert lost == []
        assert new.stats.handshakes_rejected == 0, list(new.stats.reasons)
        ts[0] = new
    finally:
        await asyncio.gather(*(t.close() for t in ts))
