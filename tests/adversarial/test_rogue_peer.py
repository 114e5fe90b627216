"""An authenticated peer that claims huge payloads cannot make a rank allocate them: every
allocation a peer can cause is capped before its bytes arrive, and the peer that exceeds a cap is
dropped with a logged reason while the rank carries on (DESIGN §11).

Over real tcp sockets: a hand-rolled client authenticates as rank 0 (it knows the secret; this is
about a buggy or hostile member of the job) and sends one header, no payload.
"""

from __future__ import annotations

import asyncio
import logging
import tracemalloc

import msgpack
import numpy as np
import pytest

from asynccoll.transport import auth
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Kind
from asynccoll.transport.tcp import TcpTransport

SECRET = b"0123456789abcdef0123456789abcdef"
SCHED = 7

CASES = {
    # a data message for an execution that finished here, claiming 1 GiB
    "late": (0, 1 << 30, None),
    # an early message for a future execution, claiming more than may be held (2 GiB)
    "held": (9, 3 << 30, None),
    # a message for a receive of unknown length (buf=None), claiming 3 GiB and 60 GiB
    "unknown-3GiB": (5, 3 << 30, "post"),
    "unknown-60GiB": (5, 60 << 30, "post"),
}


async def _rogue(addr: str, rank: int, world: int, wanted: int) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))
    nonce = auth.new_nonce()
    w.write(auth.make_hello(rank, world, wanted, nonce))
    ch = auth.parse_challenge(await r.readexactly(auth.CHALLENGE_SIZE))
    w.write(auth.connector_mac(SECRET, rank, wanted, world, nonce, ch.nonce))
    assert await r.readexactly(auth.ACCEPT_SIZE) == auth.ACCEPT
    return r, w


async def _closed(r: asyncio.StreamReader, seconds: float) -> bool:
    try:
        while await asyncio.wait_for(r.read(65536), seconds):
            pass
    except asyncio.TimeoutError:
        return False
    except OSError:
        return True
    return True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_huge_claim_drops_the_peer_without_allocating(
        case: str, caplog: pytest.LogCaptureFixture) -> None:
    execution, length, post = CASES[case]
    victim = TcpTransport(1, 3, secret=SECRET)
    addr = await victim.listen("tcp://127.0.0.1:0")
    try:
        victim.finish(SCHED, 4)  # executions 0..4 of SCHED are over here
        pending = victim.post_recv(0, SCHED, execution, 3) if post else None
        tracemalloc.start()
        try:
            r, w = await _rogue(addr, 0, 3, 1)
            hdr = msgpack.packb([PROTOCOL_VERSION, int(Kind.DATA), SCHED, execution, 3, 0, "|u1",
                                 [length], int(Format.DENSE), length])
            with caplog.at_level(logging.WARNING, logger="asynccoll.transport"):
                w.write(np.array([len(hdr), 1, 0], "<u4").tobytes() + hdr)
                assert await _closed(r, 5), "the rogue peer was not dropped"
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated for a {case} claim"
        assert any("rank 0" in rec.getMessage() for rec in caplog.records), caplog.text
        if pending is not None:
            with pytest.raises(Exception, match="rank 0"):
                await asyncio.wait_for(pending, 5)
        w.close()
        # the rank carries on: a well-behaved rank 2 connects and is served
        good = TcpTransport(2, 3, secret=SECRET)
        good_addr = await good.listen("tcp://127.0.0.1:0")
        await asyncio.gather(good.connect({1: addr}, timeout=10),
                             victim.connect({2: good_addr}, timeout=10))
        x = np.arange(1000, dtype=np.float32)
        got = victim.post_recv(2, SCHED, 10, 1, np.empty_like(x))
        await good.post_frame(1, int(Kind.DATA), SCHED, 10, 1, x.view(np.uint8).data,
                              "<f4", (1000,))
        assert np.array_equal(np.frombuffer((await asyncio.wait_for(got, 5)).payload,
                                            np.float32), x)
        await good.close()
    finally:
        await victim.close()
