"""tcp:// specifics: the handshake, limits, connection rules, real processes, fuzz, SIGKILL."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import random
import socket
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

import msgpack
import numpy as np
import pytest
from _helpers import kill_and_check_pending_fail, run_exchanging_ranks

from asynccoll.buffers import dtype_to_wire
from asynccoll.errors import (
    AuthenticationError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
    TransportError,
)
from asynccoll.transport import auth
from asynccoll.transport.frames import (
    PROTOCOL_VERSION,
    Format,
    Header,
    Kind,
    Limits,
    decode_header,
    encode_header,
)
from asynccoll.transport.tcp import TcpTransport

SECRET = b"s" * 32
SCHED = 3
_RECORD_HEAD = "<III"


def header(src: int, tag: int, arr: np.ndarray[Any, Any], execution: int = 0) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), SCHED, execution, tag, src,
                  dtype_to_wire(arr.dtype), tuple(arr.shape), int(Format.DENSE), arr.nbytes)


def run_on(loop_kind: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on a fresh loop of ``loop_kind`` ("asyncio" or "uvloop")."""
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if loop_kind == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("uvloop"), reason="uvloop is not installed"))]


async def world(n: int, secret: bytes = SECRET, **kw: Any) -> list[TcpTransport]:
    ts = [TcpTransport(r, n, secret=secret, **kw) for r in range(n)]
    addrs = {t.rank: await t.listen("tcp://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    return ts


async def raw_connect(addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def raw_handshake(addr: str, rank: int, world_size: int, wanted: int,
                        secret: bytes = SECRET) -> tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]:
    """A hand-rolled client that authenticates as ``rank`` (to send crafted frames after)."""
    r, w = await raw_connect(addr)
    nonce = auth.new_nonce()
    w.write(auth.make_hello(rank, world_size, wanted, nonce))
    ch = auth.parse_challenge(await r.readexactly(auth.CHALLENGE_SIZE))
    w.write(auth.connector_mac(secret, rank, wanted, world_size, nonce, ch.nonce))
    if await r.readexactly(auth.ACCEPT_SIZE) != auth.ACCEPT:
        raise AssertionError("not accepted")
    return r, w


async def closed_by_peer(r: asyncio.StreamReader, seconds: float = 5.0) -> bool:
    """True when the peer closes the connection within ``seconds`` (reads until EOF)."""
    try:
        while await asyncio.wait_for(r.read(65536), seconds):
            pass
    except asyncio.TimeoutError:  # before OSError: it is one since Python 3.11
        return False
    except OSError:
        return True
    return True


# -- handshake and connection rules ------------------------------------------------------------
def test_secret_is_checked() -> None:
    with pytest.raises(TypeError, match="secret"):
        TcpTransport(0, 2, secret="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="secret"):
        TcpTransport(0, 2, secret=b"short")
    with pytest.raises(ValueError, match="rank"):
        TcpTransport(2, 2, secret=SECRET)


@pytest.mark.timeout(30)
async def test_bad_addresses() -> None:
    t = TcpTransport(0, 1, secret=SECRET)
    for bad in ("tcp://127.0.0.1", "tcp://:5", "inproc://x/0", "127.0.0.1:5"):
        with pytest.raises(ValueError, match="address"):
            await t.listen(bad)
    addr = await t.listen("tcp://127.0.0.1:0")
    port = int(addr.rsplit(":", 1)[1])
    assert port > 0
    other = TcpTransport(0, 1, secret=SECRET)
    with pytest.raises(TransportError, match="cannot listen"):
        await other.listen(f"tcp://127.0.0.1:{port}")
    await t.close()
    await other.close()


@pytest.mark.timeout(30)
async def test_listening_on_a_host_name_publishes_a_dialable_address() -> None:
    ts = [TcpTransport(r, 2, secret=SECRET) for r in range(2)]
    addrs = [await t.listen("tcp://localhost:0") for t in ts]
    assert all(a.startswith("tcp://localhost:") for a in addrs)
    assert ts[1]._server is not None
    assert len(ts[1]._server.sockets) == 1  # one port for the one published address
    await asyncio.gather(ts[0].connect({1: addrs[1]}, timeout=5),
                         ts[1].connect({0: addrs[0]}, timeout=5))
    assert ts[0].peers == [1]
    for t in ts:
        await t.close()


@pytest.mark.timeout(30)
async def test_wrong_secret_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    a = TcpTransport(0, 2, secret=SECRET)
    b = TcpTransport(1, 2, secret=b"x" * 32)
    addr = await b.listen("tcp://127.0.0.1:0")
    await a.listen("tcp://127.0.0.1:0")
    with caplog.at_level(logging.WARNING, logger="asynccoll.transport"):
        with pytest.raises(AuthenticationError, match="secret"):
            await asyncio.wait_for(a.connect({1: addr}, timeout=5), 10)
        with pytest.raises(PeerLostError, match="did not connect"):
            await b.connect({0: "tcp://127.0.0.1:1"}, timeout=0.5)
    assert b.peers == []
    assert a.peers == []
    assert b.stats.handshakes_rejected >= 1
    assert a.stats.handshakes_rejected >= 1
    assert any("refusing connection" in r.getMessage() for r in caplog.records)
    await a.close()
    await b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100),
    b"\x00" * 200,
    (bytes(12) + msgpack.packb([1, 0, 0, 0, 0, 0, "|u1", [0], 0, 0])) * 3,  # frames, no handshake
])
async def test_unauthenticated_connection_is_refused(junk: bytes) -> None:
    t = TcpTransport(1, 2, secret=SECRET)
    addr = await t.listen("tcp://127.0.0.1:0")
    r, w = await raw_connect(addr)
    w.write(junk)
    assert await closed_by_peer(r), "a client that never authenticated was not disconnected"
    assert t.peers == []
    assert t.stats.handshakes_rejected == 1
    assert t.matcher.held_count == 0
    w.close()
    await t.close()


@pytest.mark.timeout(30)
async def test_silent_client_is_dropped_after_the_handshake_timeout() -> None:
    t = TcpTransport(1, 2, secret=SECRET, handshake_timeout=0.2)
    addr = await t.listen("tcp://127.0.0.1:0")
    r, w = await raw_connect(addr)
    start = time.monotonic()
    assert await closed_by_peer(r, 5.0)
    assert 0.15 < time.monotonic() - start < 2.0
    assert "within 0.2 s" in t.stats.reasons[-1]
    w.close()
    await t.close()


@pytest.mark.timeout(30)
async def test_connection_rules() -> None:
    """Only lower ranks dial in; a rank already connected cannot be claimed again."""
    ts = await world(3)
    assert [t.stats.connections for t in ts] == [2, 2, 2]  # one per pair, all dialled at once
    addr = ts[1].address
    with pytest.raises(asyncio.IncompleteReadError):  # rank 2 may not dial rank 1
        await asyncio.wait_for(raw_handshake(addr, 2, 3, 1), 5)
    with pytest.raises(asyncio.IncompleteReadError):  # rank 0 is connected already
        await asyncio.wait_for(raw_handshake(addr, 0, 3, 1), 5)
    with pytest.raises(asyncio.IncompleteReadError):  # wrong world size
        await asyncio.wait_for(raw_handshake(addr, 0, 4, 1), 5)
    assert ts[1].stats.handshakes_rejected == 3
    assert ts[1].peers == [0, 2]
    x = np.arange(10, dtype=np.float64)
    r = ts[1].post_recv(0, SCHED, 0, 1, np.empty_like(x))
    await ts[0].post_send(1, header(0, 1, x), x)
    assert np.array_equal(np.frombuffer((await asyncio.wait_for(r, 5)).payload), x)
    for t in ts:
        await t.close()


@pytest.mark.timeout(30)
async def test_connect_retries_until_the_peer_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a, b = TcpTransport(0, 2, secret=SECRET), TcpTransport(1, 2, secret=SECRET)

    async def late_listen() -> None:
        await asyncio.sleep(0.3)
        await b.listen(f"tcp://127.0.0.1:{port}")
        await b.connect({0: "tcp://unused:1"}, timeout=5)

    await asyncio.gather(a.connect({1: f"tcp://127.0.0.1:{port}"}, timeout=5), late_listen())
    assert a.peers == [1]
    assert b.peers == [0]
    await a.close()
    await b.close()


@pytest.mark.timeout(30)
async def test_connect_gives_up_at_its_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = TcpTransport(0, 2, secret=SECRET)
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="could not connect") as info:
        await a.connect({1: f"tcp://127.0.0.1:{port}"}, timeout=0.5)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, OSError | TimeoutError)
    assert time.monotonic() - start < 2.0
    await a.close()


@pytest.mark.timeout(30)
async def test_send_arguments_are_checked() -> None:
    ts = await world(2)
    x = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"header\.src"):
        ts[0].post_send(1, header(1, 1, x), x)
    with pytest.raises(ValueError, match="dst"):
        ts[0].post_send(5, header(0, 1, x), x)
    with pytest.raises(ValueError, match="payload"):
        ts[0].post_send(1, header(0, 1, x), x[:2])
    for t in ts:
        await t.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_small_message_overtakes_a_large_one_on_the_wire(loop_kind: str) -> None:
    async def body() -> None:
        ts = await world(2)
        big, small = np.ones(64 << 20, np.uint8), np.full(8, 7, np.uint8)
        r_big = ts[1].post_recv(0, SCHED, 0, 1, np.empty_like(big))
        r_small = ts[1].post_recv(0, SCHED, 0, 2, np.empty_like(small))
        ts[0].post_send(1, header(0, 1, big), big)
        ts[0].post_send(1, header(0, 2, small), small)
        await asyncio.wait_for(r_small, 10)
        assert not r_big.done(), "the small message waited for all 64 MiB of the large one"
        m = await asyncio.wait_for(r_big, 10)
        assert np.frombuffer(m.payload, np.uint8).min() == 1
        for t in ts:
            await t.close()

    run_on(loop_kind, body())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [8, 3 << 20])
async def test_a_failing_write_loses_the_peer_not_the_process(size: int) -> None:
    ts = await world(2)
    conn = ts[0]._conns[1]
    assert conn.tr is not None

    def broken(data: Any) -> None:
        raise RuntimeError("unable to perform operation: the handler is closed")

    conn.tr.write = broken  # type: ignore[method-assign]
    pending = ts[0].post_recv(1, SCHED, 0, 1, None)
    x = np.zeros(size, np.uint8)
    with pytest.raises(PeerLostError, match="write failed") as info:
        await asyncio.wait_for(ts[0].post_send(1, header(0, 1, x), x), 2)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PeerLostError):
        await asyncio.wait_for(pending, 2)
    for t in ts:
        await t.close()


# -- limits and bad frames ---------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_limit_breach_drops_only_that_peer(caplog: pytest.LogCaptureFixture) -> None:
    ts = await world(3, limits=Limits(max_payload_bytes=1000))
    victim = ts[2]
    pending = victim.post_recv(0, SCHED, 0, 9, None)
    big = np.zeros(2000, np.uint8)
    with caplog.at_level(logging.WARNING, logger="asynccoll.transport"):
        ts[0].post_send(2, header(0, 1, big), big)
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(pending, 2)
    assert info.value.rank == 0
    assert isinstance(info.value.__cause__, ProtocolError)
    assert "outside 0..1000" in str(info.value)
    assert victim.stats.frames_rejected == 1
    assert victim.peers == [1]
    assert any("closing the connection of rank 0" in r.getMessage() for r in caplog.records)
    with pytest.raises(PeerLostError):  # the offender sees the connection go
        await asyncio.wait_for(ts[0].post_recv(2, SCHED, 0, 1, None), 2)
    with pytest.raises(PeerLostError):
        await asyncio.wait_for(ts[0].post_send(2, header(0, 2, big[:10]), big[:10]), 2)
    # the other peer carries on
    x = np.arange(100, dtype=np.int16)
    r = victim.post_recv(1, SCHED, 0, 4, np.empty_like(x))
    await ts[1].post_send(2, header(1, 4, x), x)
    assert np.array_equal(np.frombuffer((await asyncio.wait_for(r, 2)).payload, np.int16), x)
    for t in ts:
        await t.close()


@pytest.mark.timeout(30)
async def test_frame_with_a_forged_source_is_rejected() -> None:
    t = TcpTransport(2, 3, secret=SECRET)
    addr = await t.listen("tcp://127.0.0.1:0")
    r, w = await raw_handshake(addr, 0, 3, 2)
    hdr = encode_header(Header(PROTOCOL_VERSION, 0, SCHED, 0, 1, 1, "|u1", (0,), 0, 0))
    w.write(np.array([len(hdr), 0, 0], "<u4").tobytes() + hdr)
    assert await closed_by_peer(r)
    assert "claims source rank 1" in t.stats.reasons[-1]
    w.close()
    await t.close()


@pytest.mark.timeout(30)
async def test_pending_sends_fail_when_the_peer_goes() -> None:
    ts = await world(2)
    big = np.zeros(64 << 20, np.uint8)
    sends = [ts[0].post_send(1, header(0, i, big), big) for i in range(4)]
    await ts[1].close()
    _, pending = await asyncio.wait(sends, timeout=2)
    assert not pending, "sends to a closed peer still pending after 2 s"
    errors = [f.exception() for f in sends if f.exception() is not None]
    assert errors, "256 MiB reached a peer that closed at once"
    assert all(isinstance(e, PeerLostError) and e.rank == 1 for e in errors), errors
    await ts[0].close()


@pytest.mark.timeout(30)
async def test_cancelling_a_send_before_it_starts_drops_it() -> None:
    ts = await world(2)
    big, small = np.zeros(64 << 20, np.uint8), np.ones(8, np.uint8)
    ts[0].post_send(1, header(0, 1, big), big)  # occupies the connection
    queued = ts[0].post_send(1, header(0, 2, small), small)
    queued.cancel()  # never started: dropped, the connection lives on
    after = ts[0].post_send(1, header(0, 3, small), small)
    await asyncio.wait_for(after, 5)
    m = await asyncio.wait_for(ts[1].post_recv(0, SCHED, 0, 3, None), 5)
    assert bytes(m.payload) == small.tobytes()
    await asyncio.wait_for(ts[1].post_recv(0, SCHED, 0, 1, None), 5)
    assert ts[1].matcher.held_count == 0  # tag 2 never arrived
    for t in ts:
        await t.close()


@pytest.mark.timeout(30)
async def test_unsolicited_messages_streaming_in_are_bounded() -> None:
    """A peer that starts many large messages nobody asked for is cut off before they are
    allocated beyond ``Limits.max_held_bytes``."""
    t = TcpTransport(1, 2, secret=SECRET, limits=Limits(max_held_bytes=1 << 20))
    addr = await t.listen("tcp://127.0.0.1:0")
    r, w = await raw_handshake(addr, 0, 2, 1)
    n = 600 << 10
    for msgid in range(2):  # each starts with 10 of its 600 KiB bytes
        hdr = encode_header(Header(PROTOCOL_VERSION, 0, SCHED, 0, msgid, 0, "|u1", (n,), 0, n))
        w.write(np.array([len(hdr), msgid, 10], "<u4").tobytes() + hdr + bytes(10))
    assert await closed_by_peer(r)
    assert "past its share of 1048576 bytes" in t.stats.reasons[-1]
    assert t.matcher.charged_bytes == 0
    w.close()
    await t.close()


@pytest.mark.timeout(30)
async def test_cancelling_a_half_sent_message_closes_the_connection() -> None:
    ts = await world(2)
    big = np.zeros(64 << 20, np.uint8)
    r = ts[1].post_recv(0, SCHED, 0, 1, np.empty_like(big))
    fut = ts[0].post_send(1, header(0, 1, big), big)
    fut.cancel()  # its first megabytes are on the wire already
    with pytest.raises(PeerLostError, match="cancelled half-way"):
        await asyncio.wait_for(ts[0].post_recv(1, SCHED, 0, 9, None), 5)
    with pytest.raises(PeerLostError):  # the receiver never sees a truncated message
        await asyncio.wait_for(r, 5)
    for t in ts:
        await t.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_mixed_traffic_both_ways_arrives_intact(loop_kind: str) -> None:
    """Small and multi-megabyte messages interleaved both ways, receives posted in random
    order before and after arrival: every payload intact and on its key."""

    async def body() -> None:
        ts = await world(2)
        rng = np.random.default_rng(5)
        sizes = rng.choice([0, 3, 4096, 70_000, 1 << 20, (3 << 20) + 5], size=120)

        async def one_way(a: TcpTransport, b: TcpTransport) -> None:
            xs = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
            order = rng.permutation(len(xs))
            early = {int(i): b.post_recv(a.rank, SCHED, 0, int(i), None) for i in order[:60]}
            sends = [a.post_send(b.rank, header(a.rank, i, x), x) for i, x in enumerate(xs)]
            await asyncio.wait_for(asyncio.gather(*sends), 20)
            late = {int(i): b.post_recv(a.rank, SCHED, 0, int(i), np.empty_like(xs[i]))
                    for i in order[60:]}
            for i, fut in (early | late).items():
                m = await asyncio.wait_for(fut, 20)
                assert bytes(m.payload) == xs[i].tobytes(), f"message {i} differs"

        await asyncio.gather(one_way(ts[0], ts[1]), one_way(ts[1], ts[0]))
        for t in ts:
            await t.close()

    run_on(loop_kind, body())


# -- fuzz ---------------------------------------------------------------------------------------
FUZZ_FRAMES = 10_000
FUZZ_WORLD = FUZZ_FRAMES + 2  # rank 0: a well-behaved peer; ranks 1..N: fuzzers; last: target


def _valid_header(rng: random.Random, src: int) -> list[Any]:
    dtype = rng.choice(["|u1", "<f4", "<f8", "<i8", "<c8", "|b1", "<f2"])
    n = rng.randrange(0, 50)
    return [PROTOCOL_VERSION, rng.randrange(3), rng.randrange(1 << 40), rng.randrange(1 << 40),
            rng.randrange(1 << 30), src, dtype, [n], 0, n * np.dtype(dtype).itemsize]


_MUTATIONS: list[tuple[int, Callable[[random.Random, int], Any]]] = [
    (0, lambda rng, src: rng.choice([0, 2, 255, -1, "1"])),  # version
    (1, lambda rng, src: rng.choice([3, 99, -1, 1.5])),  # kind
    (2, lambda rng, src: rng.choice([-1, 1 << 63, "x", None])),  # sched
    (3, lambda rng, src: rng.choice([-5, (1 << 64) - 1, b"e"])),  # execution
    (4, lambda rng, src: rng.choice([-1, [], 2.0])),  # tag
    (5, lambda rng, src: rng.choice([src + 1, 0, FUZZ_WORLD, -1, 10**9])),  # forged/bad source
    (6, lambda rng, src: rng.choice(["<U4", "O", "|V8", 7, "", ">f4" * 50])),  # dtype
    (7, lambda rng, src: rng.choice([[1] * 9, [-1], ["a"], 5, [3, 3]])),  # shape
    (8, lambda rng, src: rng.choice([4, -1, "d"])),  # format
    (9, lambda rng, src: rng.choice([-1, 1 << 40, -(1 << 63), 7])),  # length
]


def _bad_record(rng: random.Random, src: int) -> bytes:
    """A record the target must reject (checked against an independent rule below)."""
    while True:
        kind = rng.randrange(6)
        nbytes = 0
        if kind == 0:  # random bytes as a header
            hdr = rng.randbytes(rng.randrange(1, 200))
        elif kind == 1:  # one field of a valid header made invalid
            f = _valid_header(rng, src)
            i, mutate = rng.choice(_MUTATIONS)
            f[i] = mutate(rng, src)
            hdr = msgpack.packb(f)
        elif kind == 2:  # bytes of a valid header flipped, cut or extended
            hdr = bytearray(msgpack.packb(_valid_header(rng, src)))
            op = rng.randrange(3)
            if op == 0:
                for _ in range(rng.randrange(1, 4)):
                    hdr[rng.randrange(len(hdr))] = rng.randrange(256)
            elif op == 1:
                del hdr[rng.randrange(1, len(hdr)):]
            else:
                hdr += rng.randbytes(rng.randrange(1, 8))
            hdr = bytes(hdr)
        elif kind == 3:  # wrong number of fields or not an array
            f = _valid_header(rng, src)
            hdr = msgpack.packb(rng.choice([f[:-1], [*f, 0], {"v": 1}, "frame", 42]))
        elif kind == 4:  # framing: oversized header length, or continuation of nothing
            head = (rng.randrange(1025, 1 << 32), 0, 0) if rng.random() < 0.5 else \
                (0, rng.randrange(1 << 32), rng.randrange(1, 1 << 20))
            return np.array(head, "<u4").tobytes()
        else:  # a valid header whose record claims more payload than the message has
            f = _valid_header(rng, src)
            hdr = msgpack.packb(f)
            nbytes = f[9] + rng.randrange(1, 1000)
        if not _acceptable(hdr, src, nbytes):
            return np.array([len(hdr), rng.randrange(1 << 32), nbytes], "<u4").tobytes() + hdr


def _acceptable(hdr: bytes, src: int, nbytes: int) -> bool:
    if not 0 < len(hdr) <= Limits().max_header_bytes:
        return False
    try:
        h = decode_header(hdr, FUZZ_WORLD)
    except ProtocolError:
        return False
    return h.src == src and nbytes <= h.length


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fuzz_bad_frames_are_rejected_and_others_carry_on(
        caplog: pytest.LogCaptureFixture) -> None:
    run_on("asyncio", _fuzz(caplog))


async def _fuzz(caplog: pytest.LogCaptureFixture) -> None:
    target_rank = FUZZ_WORLD - 1
    target = TcpTransport(target_rank, FUZZ_WORLD, secret=SECRET)
    good = TcpTransport(0, FUZZ_WORLD, secret=SECRET)
    addr = await target.listen("tcp://127.0.0.1:0")
    await good.listen("tcp://127.0.0.1:0")
    await asyncio.gather(good.connect({target_rank: addr}, timeout=10),
                         target.connect({0: good.address}, timeout=10))
    rng = random.Random(20261121)
    records = [_bad_record(rng, src) for src in range(1, FUZZ_FRAMES + 1)]
    refused: list[int] = []

    async def fuzzer(worker: int) -> None:
        for src in range(1 + worker, FUZZ_FRAMES + 1, 8):
            r, w = await raw_handshake(addr, src, FUZZ_WORLD, target_rank)
            w.write(records[src - 1])
            if not await closed_by_peer(r, 10):
                refused.append(src)
            w.close()

    async def well_behaved() -> int:
        n = 0
        while not done.is_set():
            x = np.random.default_rng(n).random(8192)
            back = good.post_recv(target_rank, SCHED, n, 1, np.empty_like(x))
            r = target.post_recv(0, SCHED, n, 1, None)
            await good.post_send(target_rank, header(0, 1, x, n), x)
            m = await asyncio.wait_for(r, 5)
            y = np.frombuffer(m.payload, np.float64)
            h = header(target_rank, 1, y, n)
            await target.post_send(0, h, y)
            got = np.frombuffer((await asyncio.wait_for(back, 5)).payload, np.float64)
            assert np.array_equal(got, x), f"round {n} corrupted"
            n += 1
        return n

    done = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="asynccoll.transport"):
        peer = asyncio.ensure_future(well_behaved())
        await asyncio.wait_for(asyncio.gather(*(fuzzer(i) for i in range(8))), 200)
        done.set()
        rounds = await asyncio.wait_for(peer, 10)
    assert refused == [], f"{len(refused)} bad frames were not answered by a disconnect"
    assert target.stats.frames_rejected == FUZZ_FRAMES
    rejects = [r for r in caplog.records if "closing the connection of rank" in r.getMessage()]
    assert len(rejects) == FUZZ_FRAMES
    assert all(r.getMessage().split(": ", 1)[1] for r in rejects)
    assert rounds > 10, "the well-behaved peer made no progress while the fuzz ran"
    assert target.peers == [0]
    assert target.matcher.held_count == 0
    await good.close()
    await target.close()


# -- real processes -----------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, addr_q: Any, peers_q: Any, result_q: Any,
               secret: bytes, loop_kind: str, connect_timeout: float) -> None:
    try:
        run_on(loop_kind, _rank_body(rank, world_size, secret, addr_q, peers_q,
                                     connect_timeout))
        result_q.put((rank, None))
    except BaseException:
        result_q.put((rank, traceback.format_exc()))


async def _rank_body(rank: int, world_size: int, secret: bytes, addr_q: Any,
                     peers_q: Any, connect_timeout: float) -> None:
    t = TcpTransport(rank, world_size, secret=secret)
    addr_q.put((rank, await t.listen("tcp://127.0.0.1:0")))
    loop = asyncio.get_running_loop()
    peers = await loop.run_in_executor(None, peers_q.get, True, 30)
    await t.connect({r: a for r, a in peers.items() if r != rank}, timeout=connect_timeout)
    sizes = [0, 8, 100_003, 4 << 20]
    others = [p for p in range(world_size) if p != rank]

    def data(src: int, dst: int, i: int) -> np.ndarray[Any, Any]:
        n = sizes[i] // 4
        return np.random.default_rng([src, dst, i]).standard_normal(n).astype(np.float32)

    recvs = {(p, i): t.post_recv(p, SCHED, 0, i, None if i % 2 else np.empty(sizes[i] // 4,
                                                                             np.float32))
             for p in others for i in range(len(sizes))}
    sends = [t.post_send(p, header(rank, i, x), x) for p in others for i in range(len(sizes))
             for x in [data(rank, p, i)]]
    await asyncio.wait_for(asyncio.gather(*sends), 20)
    for (p, i), fut in recvs.items():
        m = await asyncio.wait_for(fut, 20)
        assert m.header.src == p
        assert m.header.dtype == "<f4"
        assert np.array_equal(np.frombuffer(m.payload, np.float32), data(p, rank, i)), (p, i)
    # a barrier, so nobody closes while a peer still reads
    z = np.zeros(1, np.uint8)
    await asyncio.gather(*(t.post_send(p, header(rank, 99, z), z) for p in others))
    await asyncio.wait_for(asyncio.gather(*(t.post_recv(p, SCHED, 0, 99, None) for p in others)),
                           20)
    await t.close()


def _run_ranks(world_size: int, secrets: list[bytes], loop_kind: str,
               timeout: float = 60.0, connect_timeout: float = 20.0) -> dict[int, str | None]:
    """Start ``world_size`` spawned ranks; return rank -> traceback (None when it passed)."""
    return run_exchanging_ranks(_rank_main, world_size,
                                lambda r: (secrets[r], loop_kind, connect_timeout),
                                timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_processes_exchange_over_tcp(loop_kind: str) -> None:
    results = _run_ranks(3, [SECRET] * 3, loop_kind)
    failed = {r: tb for r, tb in results.items() if tb}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_process_with_the_wrong_secret_fails_and_reports_why() -> None:
    results = _run_ranks(2, [SECRET, b"w" * 32], "asyncio", timeout=60, connect_timeout=1.5)
    assert results[0] is not None
    assert results[1] is not None
    assert "AuthenticationError" in results[0]  # rank 0 dials rank 1 and checks its proof
    assert "PeerLostError" in results[1] or "AuthenticationError" in results[1]


def _streamer(secret: bytes, target: str, started: Any) -> None:
    async def body() -> None:
        t = TcpTransport(0, 2, secret=secret)
        await t.connect({1: target}, timeout=20)
        x = np.ones(8 << 20, np.uint8)
        started.set()
        tag = 0
        while True:
            await t.post_send(1, header(0, tag, x), x)
            tag += 1

    asyncio.run(body())


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_sigkill_mid_transfer_fails_pending_receives_promptly(loop_kind: str) -> None:
    run_on(loop_kind, _sigkill())


async def _sigkill() -> None:
    ctx = mp.get_context("spawn")
    t = TcpTransport(1, 2, secret=SECRET)
    addr = await t.listen("tcp://127.0.0.1:0")
    started = ctx.Event()
    proc = ctx.Process(target=_streamer, args=(SECRET, addr, started), daemon=True)
    try:
        proc.start()
        await t.connect({0: "tcp://127.0.0.1:1"}, timeout=30)
        recvs = [t.post_recv(0, SCHED, 0, tag, np.empty(8 << 20, np.uint8))
                 for tag in range(10_000)]
        await asyncio.wait_for(recvs[2], 20)  # data is streaming
        # what the kernel had already buffered may still arrive; everything else must fail
        await kill_and_check_pending_fail(t, proc, recvs, peer=0, slack=10)
        await t.close()
        with pytest.raises(TransportClosedError):
            await t.post_recv(0, SCHED, 0, 1, None)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


# -- coalescing -----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_small_messages_of_one_turn_share_a_write_and_keep_their_order(loop_kind: str) -> None:
    async def body() -> None:
        ts = await world(2)
        conn = ts[0]._conns[1]
        assert conn.tr is not None
        writes: list[int] = []

        class Counting:  # uvloop's transports do not let a test replace their methods
            def __init__(self, tr: Any) -> None:
                self._tr = tr

            def write(self, data: Any) -> None:
                writes.append(len(data))
                self._tr.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._tr, name)

        conn.tr = Counting(conn.tr)  # type: ignore[assignment]
        xs = [np.full(4, i, np.int32) for i in range(5)]
        big = np.full(3 << 20, 9, np.uint8)
        got = [ts[1].post_recv(0, SCHED, 0, i, np.empty_like(x)) for i, x in enumerate(xs)]
        got_big = ts[1].post_recv(0, SCHED, 0, 99, np.empty_like(big))
        sent = [ts[0].post_send(1, header(0, i, x), x) for i, x in enumerate(xs[:3])]
        assert len(writes) == 1  # the first goes at once; the next two wait for the turn's end
        sent.append(ts[0].post_send(1, header(0, 99, big), big))  # flushes the two first
        sent += [ts[0].post_send(1, header(0, i + 3, x), x) for i, x in enumerate(xs[3:])]
        assert len(writes) >= 3
        await asyncio.wait_for(asyncio.gather(*sent), 10)
        for i, g in enumerate(got):
            assert np.frombuffer((await asyncio.wait_for(g, 10)).payload, np.int32)[0] == i
        assert np.frombuffer((await asyncio.wait_for(got_big, 10)).payload, np.uint8).min() == 9
        # a later turn: the first message is written at once again, alone
        writes.clear()
        await asyncio.sleep(0)
        await ts[0].post_send(1, header(0, 7, xs[0]), xs[0])
        assert len(writes) == 1
        for t in ts:
            await t.close()

    run_on(loop_kind, body())


@pytest.mark.timeout(30)
async def test_coalesced_sends_fail_when_the_connection_breaks() -> None:
    ts = await world(2)
    x = np.zeros(8, np.uint8)
    first = ts[0].post_send(1, header(0, 1, x), x)
    rest = [ts[0].post_send(1, header(0, 2 + i, x), x) for i in range(3)]
    ts[0]._conns[1].abort(PeerLostError(1, "test: broken"))
    await first
    for fut in rest:
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(fut, 5)
    for t in ts:
        await t.close()
