"""One memory budget per rank: a rogue authenticated peer that mixes held, streaming and
header-only claims cannot take a rank past its cap; it is dropped with a logged reason and
everything it made the rank hold is released at once (DESIGN §11).

The victim is a real process (a tcp or ucx transport with a 256 MiB budget, set through
``Limits.max_held_bytes``); the rogue, in the test process, knows the secret and writes frames by
hand. The victim's resident memory is read from ``/proc``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from asynccoll.transport import auth
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Kind

ROOT = str(Path(__file__).parents[2])
SECRET = b"0123456789abcdef0123456789abcdef"
MiB = 1 << 20
CAP = 256 * MiB

pytestmark = [pytest.mark.multiprocess]

VICTIM = """
import asyncio, logging, sys
from asynccoll.transport.frames import Limits
from asynccoll.transport.registry import make_transport

async def main():
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    scheme, limits = sys.argv[3], Limits(max_held_bytes=int(sys.argv[2]))
    t = make_transport(scheme, 1, 2, secret=sys.argv[1].encode(), limits=limits)
    print(await t.listen(f"{scheme}://127.0.0.1:0"), flush=True)  # rank 0 dials in
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        m = t.matcher
        print(m.charged_bytes, m.held_count, int(m.is_lost(0)), flush=True)
    await t.close()

asyncio.run(main())
"""


class _Victim:
    """Rank 1 in a process of its own: its address, its budget in use, its memory."""

    def __init__(self, scheme: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, SECRET.decode(), str(CAP), scheme],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT})
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()

    def stat(self) -> list[int]:
        """[bytes charged, messages held, whether rank 0 is dropped]."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return [int(v) for v in self.proc.stdout.readline().split()]

    def rss(self) -> tuple[int, int]:
        return _rss(self.proc.pid)

    def settled(self, base: int) -> int:
        """Resident bytes above ``base`` once they stop falling (5 s at most)."""
        deadline = time.monotonic() + 5
        while self.rss()[0] - base > 32 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.rss()[0] - base

    def end(self) -> str:
        """Stop it; its log."""
        return self.proc.communicate(input="", timeout=20)[1]


def _check(kind: str, peak: int, after: int, charged_after: list[int], err: str,
           reason: str) -> None:
    print(f"{kind} victim RSS above its start: peak {peak / MiB:.0f} MiB, after the drop "
          f"{after / MiB:.0f} MiB (cap {CAP / MiB:.0f} MiB)")
    assert peak < CAP + 64 * MiB, f"peak {peak / MiB:.0f} MiB"
    assert charged_after[:2] == [0, 0]
    assert after < 32 * MiB, f"{after / MiB:.0f} MiB still resident after the drop"
    assert f"{reason}rank 0 claims 33554432 bytes for an early message while holding " \
        "268435456 here: past its share" in err, err


def _rss(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of ``pid``."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10)


def _record(hlen: int, msgid: int, nbytes: int) -> bytes:
    return np.array([hlen, msgid, nbytes], "<u4").tobytes()


def _header(msgid: int, length: int, execution: int = 9) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, int(Kind.DATA), 7, execution, msgid, 0, "|u1",
                          [length], int(Format.DENSE), length])


async def _rogue(addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))
    nonce = auth.new_nonce()
    w.write(auth.make_hello(0, 2, 1, nonce))
    ch = auth.parse_challenge(await r.readexactly(auth.CHALLENGE_SIZE))
    w.write(auth.connector_mac(SECRET, 0, 1, 2, nonce, ch.nonce))
    assert await r.readexactly(auth.ACCEPT_SIZE) == auth.ACCEPT
    return r, w


async def _send(w: asyncio.StreamWriter, msgid: int, length: int, send: int) -> None:
    """Start message ``msgid`` claiming ``length`` bytes and send ``send`` of them."""
    first = min(send, MiB)
    w.write(_record(len(h := _header(msgid, length)), msgid, first) + h + bytes(first))
    sent = first
    while sent < send:
        n = min(send - sent, MiB)
        w.write(_record(0, msgid, n) + bytes(n))
        sent += n
        await w.drain()
    await w.drain()


@pytest.mark.timeout(60)
def test_a_rogue_peer_mixing_claims_stays_within_the_cap_and_is_dropped() -> None:
    victim = _Victim("tcp")
    try:
        base = victim.rss()[0]

        async def attack() -> bool:
            r, w = await _rogue(victim.address)
            await _send(w, 1, 96 * MiB, 96 * MiB)  # held: an early message, complete
            await _send(w, 2, 96 * MiB, 64 * MiB)  # streaming: two thirds of it sent
            await _send(w, 3, 64 * MiB, 0)  # header-only: a claim, never sent
            await asyncio.sleep(0.5)
            assert victim.stat() == [256 * MiB, 1, 0]  # the whole budget, not a byte more
            await _send(w, 4, 32 * MiB, 0)  # one claim more: past the cap
            try:
                while await asyncio.wait_for(r.read(65536), 5):
                    pass
            except (TimeoutError, asyncio.TimeoutError):
                return False
            except OSError:
                pass
            w.close()
            return True

        assert asyncio.run(asyncio.wait_for(attack(), 40)), "the rogue peer was not dropped"
        peak = victim.rss()[1] - base
        after = victim.settled(base)
        charged_after = victim.stat()
    finally:
        err = victim.end()
    _check("tcp", peak, after, charged_after, err, "closing the connection of rank 0: ")


@pytest.mark.timeout(60)
def test_a_rogue_ucx_peer_mixing_claims_stays_within_the_cap_and_is_dropped() -> None:
    pytest.importorskip("ucxx")
    from asynccoll.buffers import dtype_to_wire
    from asynccoll.transport.frames import Header, encode_header
    from asynccoll.transport.ucx import UcxTransport
    from asynccoll.transport.ucx.library import load
    from asynccoll.transport.ucx.transport import PREFIX

    victim = _Victim("ucx")

    def header(tag: int, n: int) -> Header:
        return Header(PROTOCOL_VERSION, int(Kind.DATA), 7, 9, tag, 0,
                      dtype_to_wire(np.dtype(np.uint8)), (n,), int(Format.DENSE), n)

    try:
        async def attack() -> tuple[int, list[int]]:
            rogue = UcxTransport(0, 2, secret=SECRET)
            await rogue.connect({1: victim.address}, timeout=20)
            await asyncio.sleep(0.5)
            base = victim.rss()[0]
            try:
                for tag in (1, 2):  # held: two complete early messages of 96 MiB
                    x = np.ones(96 * MiB, np.uint8)
                    await rogue.post_send(1, header(tag, x.nbytes), x)

                def claim(tag: int, n: int) -> None:  # a header whose payload never comes
                    raw = encode_header(header(tag, n))
                    keep = load().Array(PREFIX.pack(len(raw), 0) + raw)
                    p = rogue._peers[1]
                    rogue._progress.watch(p.tx.tag_send(keep, p.send_htag),
                                          lambda exc, k=keep: None)

                claim(3, 64 * MiB)
                await asyncio.sleep(1.0)
                full = victim.stat()
                claim(4, 32 * MiB)  # past the cap: dropped
                for _ in range(100):
                    if (s := victim.stat())[2]:
                        break
                    await asyncio.sleep(0.05)
                assert s[2], "the rogue peer was not dropped"
                return base, full
            finally:
                await rogue.close()

        base, full = asyncio.run(asyncio.wait_for(attack(), 40))
        assert full == [256 * MiB, 2, 0]
        peak = victim.rss()[1] - base
        after = victim.settled(base)
        charged_after = victim.stat()
    finally:
        err = victim.end()
    _check("ucx", peak, after, charged_after, err, "disconnecting rank 0: ")
