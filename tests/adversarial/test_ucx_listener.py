"""The UCX listener under idle and garbage connections (issue: unauthenticated connections).

UCX's connection manager accepts a socket before the application hears of it and gives no
hook to time it out (docs/transports.md, "Exposure"). What holds is checked here over real UCX
on loopback: the ranks wire up and serve each other while rogue sockets hang around, and what
the rogue sockets cost is returned when their client closes them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket

import numpy as np
import pytest

from asynccoll.transport.frames import Kind

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                reason="ucxx is not installed (pip install 'asynccoll[ucx]')")

SECRET = b"v" * 32


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


@pytest.mark.timeout(60)
async def test_rogue_sockets_on_the_ucx_listener_cost_only_while_they_are_open() -> None:
    from asynccoll.transport.ucx import UcxTransport

    ts = [UcxTransport(r, 3, secret=SECRET) for r in range(3)]
    addrs = {t.rank: await t.listen("ucx://127.0.0.1:0") for t in ts}
    rogues: list[socket.socket] = []
    try:
        await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank},
                                         timeout=20) for t in ts))
        base = _fds()
        # idle and garbage connections to every rank's listener
        for i in range(60):
            s = socket.create_connection(("127.0.0.1", _port(addrs[i % 3])), timeout=5)
            if i % 4 == 0:
                s.sendall(b"\xff" * 200)
            rogues.append(s)
        await asyncio.sleep(0.5)
        assert _fds() - base >= 60  # the clients' own ends
        # the ranks still serve each other
        x = np.arange(4096, dtype=np.float32)
        got = ts[1].post_recv(0, 1, 0, 1, np.empty_like(x))
        await ts[0].post_frame(1, int(Kind.DATA), 1, 0, 1, x.view(np.uint8).data, "<f4",
                               (4096,))
        out = np.frombuffer((await asyncio.wait_for(got, 10)).payload, np.float32)
        assert np.array_equal(out, x)
        # what the rogue sockets held is returned once their client closes them
        for s in rogues:
            s.close()
        rogues.clear()
        for _ in range(100):
            if _fds() <= base:
                break
            await asyncio.sleep(0.05)
        assert _fds() <= base, f"{_fds() - base} descriptors still held"
    finally:
        for s in rogues:
            s.close()
        for t in ts:
            await t.close()


@pytest.mark.timeout(90)
async def test_a_flood_of_refused_dials_logs_a_bounded_number_of_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    # (a restarted rank that a member will not take back yet dials it again and again: one
    # warning per refusal filled the log; at most 10 per 10 s now, as over tcp)
    import logging

    from asynccoll.errors import AuthenticationError
    from asynccoll.transport.ucx import UcxTransport

    caplog.set_level(logging.WARNING, "asynccoll.transport.ucx")
    member = UcxTransport(1, 2, secret=SECRET)
    addr = await member.listen("ucx://127.0.0.1:0")
    try:
        for _ in range(14):
            stranger = UcxTransport(0, 2, secret=b"s" * 32)
            await stranger.listen("ucx://127.0.0.1:0")
            try:
                with pytest.raises(AuthenticationError):
                    await asyncio.wait_for(stranger.connect({1: addr}, timeout=5), 10)
            finally:
                await stranger.close()
        await asyncio.sleep(0.2)  # the member's side of the last refusal
        lines = [m for m in caplog.messages if "refused a connection" in m]
        assert 1 <= len(lines) <= 10, lines
    finally:
        await member.close()
