"""Unauthenticated connections cost little: a flood of them (silent, garbage, slow) keeps the
memory they cost and the log lines they cause bounded, and the rank still serves its peers.

Over real tcp sockets on loopback; every loop below is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import logging
import tracemalloc

import numpy as np
import pytest

from asynccoll.transport.frames import Kind
from asynccoll.transport.tcp import TcpTransport

pytestmark = pytest.mark.alone  # timing-sensitive: runs after the parallel part (Makefile)

SECRET = b"0123456789abcdef0123456789abcdef"


async def _open(host: str, port: int, junk: bytes) -> asyncio.StreamWriter | None:
    try:
        _, w = await asyncio.open_connection(host, port)
    except OSError:
        return None
    if junk:
        w.write(junk)
    return w


@pytest.mark.timeout(60)
async def test_a_flood_of_unauthenticated_connections_is_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    victim = TcpTransport(1, 2, secret=SECRET, handshake_timeout=2.0)
    addr = await victim.listen("tcp://127.0.0.1:0")
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    good = TcpTransport(0, 2, secret=SECRET)
    writers: list[asyncio.StreamWriter] = []
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="asynccoll.transport"):
            for batch in range(5):  # 2,000 connections, 400 open at a time
                junk = [b"", b"\x00" * 7, b"GET / HTTP/1.0\r\n\r\n", b"\xff" * 300][batch % 4]
                ws = await asyncio.gather(*(_open(host, int(port), junk) for _ in range(400)))
                writers = [w for w in ws if w is not None]
                await asyncio.sleep(0.05)
                for w in writers:
                    w.close()
            # the rank still serves a well-behaved peer while slow ones hang around
            await good.connect({1: addr}, timeout=10)
            await asyncio.sleep(0.2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    x = np.arange(1000, dtype=np.float32)
    got = victim.post_recv(0, 1, 0, 1, np.empty_like(x))
    await good.post_frame(1, int(Kind.DATA), 1, 0, 1, x.view(np.uint8).data, "<f4", (1000,))
    assert np.array_equal(np.frombuffer((await asyncio.wait_for(got, 5)).payload, np.float32), x)
    refusals = [r for r in caplog.records if "refusing connection" in r.getMessage()]
    assert victim.stats.handshakes_rejected >= 1000
    assert len(refusals) <= 30, f"{len(refusals)} log lines for the flood"
    # 400 open connections x 256 KiB staging buffers would be 100 MiB
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB allocated during the flood"
    await good.close()
    await victim.close()
