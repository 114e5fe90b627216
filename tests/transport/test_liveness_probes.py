"""Liveness probes over real tcp sockets and ucx endpoints, in one process (the multi-process
cases are in ``tests/adversarial/test_liveness.py``): a silent peer is dropped as from a broken
connection, probing peers are not, a stall of this rank's own loop blames nobody."""

from __future__ import annotations

import asyncio
import time

import pytest

from asynccoll.errors import PeerLostError
from asynccoll.transport.base import Transport
from asynccoll.transport.liveness import SilentPeerError
from asynccoll.transport.tcp import TcpTransport

SECRET = b"l" * 32

pytestmark = [pytest.mark.timeout(20), pytest.mark.alone]


async def _pair(scheme: str) -> list[Transport]:
    if scheme == "ucx":
        pytest.importorskip("ucxx")
        from asynccoll.transport.ucx import UcxTransport

        ts: list[Transport] = [UcxTransport(r, 2, secret=SECRET) for r in range(2)]
    else:
        ts = [TcpTransport(r, 2, secret=SECRET) for r in range(2)]
    addrs = [await t.listen(f"{scheme}://127.0.0.1:0") for t in ts]
    await asyncio.gather(ts[0].connect({1: addrs[1]}, timeout=5),
                         ts[1].connect({0: addrs[0]}, timeout=5))
    return ts


@pytest.fixture(params=["tcp", "ucx"])
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_silent_peer_is_dropped_as_from_a_broken_connection(scheme: str) -> None:
    ts = await _pair(scheme)
    lost: list[tuple[int, PeerLostError]] = []
    ts[0].on_peer_lost(lambda r, e: lost.append((r, e)))
    pending = ts[0].post_recv(1, 5, 0, 0)
    t0 = time.monotonic()
    ts[0].start_liveness(0.5)  # rank 1 never probes: silent, as a stopped process
    with pytest.raises(SilentPeerError, match=r"peer rank 1 lost: answered no liveness probe "
                                              r"for 0\.\d s"):
        await asyncio.wait_for(pending, 5)
    took = time.monotonic() - t0
    assert 0.5 <= took < 1.5, took
    assert [r for r, _ in lost] == [1]
    assert isinstance(lost[0][1], SilentPeerError)
    for t in ts:
        await t.close()


async def test_probing_peers_are_not_dropped_and_a_stall_here_blames_nobody(
        scheme: str) -> None:
    ts = await _pair(scheme)
    lost: list[int] = []
    for t in ts:
        t.on_peer_lost(lambda r, e: lost.append(r))
        t.start_liveness(0.3)
    await asyncio.sleep(1.2)  # four liveness times of probes
    time.sleep(0.6)  # noqa: ASYNC251 - this loop (both ranks') held up past the liveness time
    await asyncio.sleep(0.5)
    assert lost == []
    assert not ts[0].matcher.is_lost(1)
    for t in ts:
        await t.close()


async def test_bad_liveness_times_are_refused() -> None:
    t = TcpTransport(0, 2, secret=SECRET)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="liveness seconds must be > 0"):
            t.start_liveness(bad)
    with pytest.raises(ValueError, match="rank must be another rank"):
        t.drop_peer(0, PeerLostError(0))
    await t.close()
