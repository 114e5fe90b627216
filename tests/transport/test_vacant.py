"""A job that may grow: vacant ranks (``Transport.vacate``) over real tcp sockets and real UCX
endpoints. The first world's ranks connect among themselves; a rank of the capacity that no
process holds yet fails receives at once, and a process given it later connects as a restarted
rank does (``rejoin``), admitted only where rejoins are."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np
import pytest
from _rejoin_helpers import ping

from asynccoll.errors import PeerLostError

SECRET = b"v" * 32
SCHED = 11

pytestmark = pytest.mark.timeout(60)

SCHEMES = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"))]


def _make(scheme: str, rank: int, capacity: int) -> Any:
    if scheme == "tcp":
        from asynccoll.transport.tcp import TcpTransport
        return TcpTransport(rank, capacity, secret=SECRET)
    from asynccoll.transport.ucx import UcxTransport
    return UcxTransport(rank, capacity, secret=SECRET)


async def _first_world(scheme: str, n: int, capacity: int) -> tuple[list[Any], dict[int, str]]:
    ts = [_make(scheme, r, capacity) for r in range(n)]
    addrs = {t.rank: await t.listen(f"{scheme}://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    for t in ts:
        t.vacate(range(n, capacity))
    return ts, addrs


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_process_takes_a_vacant_rank_and_talks_to_everyone(scheme: str) -> None:
    ts, addrs = await _first_world(scheme, 2, 4)
    new = None
    try:
        for t in ts:
            t.admit_rejoins = True
            assert t.vacant == {2, 3}
        with pytest.raises(PeerLostError, match="no process holds this rank yet"):
            await asyncio.wait_for(ts[0].post_recv(2, SCHED, 1, 0), 5)
        joined: list[tuple[int, int]] = []
        for t in ts:
            t.on_peer_joined(lambda r, me=t.rank: joined.append((me, r)))
        new = _make(scheme, 2, 4)
        await new.listen(f"{scheme}://127.0.0.1:0")
        assert await new.rejoin(addrs, timeout=10) == [0, 1]
        new.vacate([3])
        await asyncio.sleep(0.1)
        assert sorted(joined) == [(0, 2), (1, 2)]
        assert [t.vacant for t in ts] == [{3}, {3}]
        for t in ts:  # both ways, with receives posted after the vacancy failed one
            assert await ping(t, new, 2, SCHED) == (np.arange(4, dtype=np.int64) + 100 * t.rank
                                                    + 2).tobytes()
            assert await ping(new, t, 3, SCHED) == (np.arange(4, dtype=np.int64) + 202
                                                    + 1).tobytes()
    finally:
        for t in [*ts, *([new] if new is not None else [])]:
            await t.close()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_vacant_rank_is_refused_where_rejoins_are_not_admitted(scheme: str) -> None:
    ts, addrs = await _first_world(scheme, 2, 3)
    try:
        new = _make(scheme, 2, 3)
        await new.listen(f"{scheme}://127.0.0.1:0")
        with pytest.raises(PeerLostError, match="no rank of the job admitted this one"):
            await new.rejoin(addrs, timeout=1.5)
        await new.close()
        assert all(t.matcher.is_lost(2) for t in ts)
    finally:
        for t in ts:
            await t.close()


async def test_vacate_checks_its_ranks_and_leaves_a_connected_one_alone() -> None:
    ts, _ = await _first_world("tcp", 2, 3)
    try:
        with pytest.raises(ValueError, match=r"vacate: rank must be another rank in 0\.\.2"):
            ts[0].vacate([3])
        with pytest.raises(ValueError, match="another rank"):
            ts[0].vacate([0])
        ts[0].vacate([1])  # connected (it met the others first): not vacant
        assert ts[0].vacant == {2}
        assert await ping(ts[1], ts[0], 1, SCHED) == (np.arange(4, dtype=np.int64) + 101
                                                      ).tobytes()
    finally:
        for t in ts:
            await t.close()


async def test_a_stranger_cannot_take_a_vacant_rank() -> None:
    from asynccoll.transport.tcp import TcpTransport

    ts, addrs = await _first_world("tcp", 2, 3)
    try:
        for t in ts:
            t.admit_rejoins = True
        stranger = TcpTransport(2, 3, secret=b"x" * 32)
        await stranger.listen("tcp://127.0.0.1:0")
        with pytest.raises(PeerLostError):
            await stranger.rejoin(addrs, timeout=1.5)
        await stranger.close()
        assert [t.vacant for t in ts] == [{2}, {2}]  # still vacant: nobody was admitted
        assert await ping(ts[0], ts[1], 1, SCHED) == (np.arange(4, dtype=np.int64) + 1
                                                      ).tobytes()
    finally:
        for t in ts:
            await t.close()
