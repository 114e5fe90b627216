"""The transport conformance suite: what every :class:`~asynccoll.transport.base.Transport` must do.

``await check_transport(make_pair)`` runs every check; ``make_pair()`` must return an async
context manager yielding two connected transports, rank 0 and rank 1 of a world of 2, and
closing both on exit (a check may close one or both first; ``close()`` must be idempotent).
Each check gets a fresh pair. A failure raises ``AssertionError`` naming the check and what went
wrong; every wait is bounded, so a hang fails instead of blocking.

The checks (see :data:`CHECKS`): payload sizes from 0 B to 64 MiB in several dtypes, receives
posted before and after arrival, receives of unknown length (``buf=None``), order of frames with
the same key, different tags matched out of order, sends to oneself, many concurrent messages,
a large payload not stalling a small one on another key, headers built by ``post_frame``,
``close()`` failing pending operations with :class:`TransportClosedError`, posting, listening and
connecting after ``close()``, a peer's close failing pending receives with :class:`PeerLostError`,
and argument checking, which every transport must do alike (the same exception types): a peer
outside ``0..P-1`` on send and receive (``ValueError``), a forged source (``ValueError``), a
payload shorter than its header says (``ValueError``), a second ``listen()`` (``RuntimeError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import numpy as np

from ..buffers import dtype_to_wire
from ..errors import PeerLostError, TransportClosedError
from ..transport.base import Transport
from ..transport.frames import PROTOCOL_VERSION, Format, Header, Kind, Message

__all__ = ["CHECKS", "MakePair", "check_transport"]

MakePair = Callable[[], AbstractAsyncContextManager[tuple[Transport, Transport]]]
Check = Callable[[MakePair, int], Awaitable[None]]

MiB = 1 << 20
#: payload sizes (bytes) of the size check; those above ``max_size`` are skipped
SIZES = (0, 1, 7, 4096, 65536 + 3, MiB, 16 * MiB, 64 * MiB)
DTYPES = ("uint8", "float32", "float64", "int64", "complex64", "bool", "float16", "int16")
SCHED = 7
WAIT = 10.0  # seconds any single operation may take before the check fails

CHECKS: dict[str, Check] = {}


def _check(fn: Check) -> Check:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


async def check_transport(make_pair: MakePair, *, only: Iterable[str] | None = None,
                          max_size: int = 64 * MiB, timeout: float = 120.0) -> None:
    """Run the checks named in ``only`` (default: all of :data:`CHECKS`) with fresh pairs.

    ``max_size`` caps the payload sizes tried; ``timeout`` bounds each check. Raises
    ``AssertionError`` naming the failed check, ``KeyError`` for an unknown check name.
    """
    names = list(CHECKS) if only is None else list(only)
    for name in names:
        if name not in CHECKS:
            raise KeyError(f"unknown check {name!r}; known: {sorted(CHECKS)}")
    for name in names:
        try:
            await asyncio.wait_for(CHECKS[name](make_pair, max_size), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"conformance check {name!r} took over {timeout} s") from None
        except AssertionError as exc:
            raise AssertionError(f"conformance check {name!r}: {exc}") from exc


# -- helpers ---------------------------------------------------------------------------------
def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def _header(src: int, tag: int, arr: np.ndarray[Any, Any], *, execution: int = 0) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), SCHED, execution, tag, src,
                  dtype_to_wire(arr.dtype), tuple(int(d) for d in arr.shape), int(Format.DENSE),
                  int(arr.nbytes))


def _data(nbytes: int, dtype: str = "uint8", seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bytes viewed as ``dtype`` (compare byte-wise: floats may hold NaNs)."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, nbytes - nbytes % dt.itemsize,
                                               dtype=np.uint8)
    if dt == np.bool_:
        raw &= 1
    return raw.view(dt)


def _same(a: np.ndarray[Any, Any], payload: memoryview | np.ndarray[Any, Any]) -> bool:
    return bool(np.array_equal(a.reshape(-1).view(np.uint8),
                               np.frombuffer(payload, dtype=np.uint8)))


async def _within(aw: Awaitable[Any], what: str, seconds: float = WAIT) -> Any:
    try:
        return await asyncio.wait_for(aw, seconds)
    except asyncio.TimeoutError:
        raise AssertionError(f"{what} did not complete within {seconds} s") from None


async def _fails_with(fut: Awaitable[Any], exc_type: type[BaseException], what: str,
                      seconds: float = WAIT) -> BaseException:
    try:
        await asyncio.wait_for(fut, seconds)
    except exc_type as exc:
        return exc
    except asyncio.TimeoutError:
        raise AssertionError(f"{what} still pending after {seconds} s") from None
    except BaseException as exc:
        raise AssertionError(f"{what} raised {exc!r}, expected {exc_type.__name__}") from exc
    raise AssertionError(f"{what} succeeded, expected {exc_type.__name__}")


def _post_fails(call: Callable[[], Any], exc_type: type[BaseException], what: str
                ) -> Awaitable[BaseException]:
    """A post that must fail: raising at once and returning a failed future both count."""
    try:
        fut = call()
    except exc_type as exc:
        done: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        done.set_result(exc)
        return done
    return _fails_with(fut, exc_type, what)


async def _arrived(t: Transport, n: int) -> None:
    """Wait (bounded) until ``t`` holds ``n`` early messages, so that receives posted next are
    posted after arrival; transports that hold messages elsewhere just get 0.5 s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 0.5
    # the interface has no arrival event to wait on; a short bounded poll is fine in a test
    while t.matcher.held_count < n and loop.time() < end:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def _exchange(a: Transport, b: Transport, arrs: list[np.ndarray[Any, Any]],
                    tags: list[int]) -> list[Message]:
    """Send ``arrs`` from ``a`` to ``b`` on ``tags``, receives posted first; return messages."""
    recvs = [b.post_recv(a.rank, SCHED, 0, tag, np.empty_like(x)) for x, tag in
             zip(arrs, tags, strict=True)]
    sends = [a.post_send(b.rank, _header(a.rank, tag, x), x) for x, tag in
             zip(arrs, tags, strict=True)]
    await _within(asyncio.gather(*sends), f"sends {a.rank}->{b.rank}")
    msgs: list[Message] = await _within(asyncio.gather(*recvs), f"receives {a.rank}->{b.rank}")
    return msgs


# -- the checks ------------------------------------------------------------------------------
@_check
async def check_sizes(make_pair: MakePair, max_size: int) -> None:
    """Payloads of 0 B .. 64 MiB in several dtypes, both directions at once, arrive intact."""
    sizes = [s for s in SIZES if s <= max_size]
    async with make_pair() as (t0, t1):
        for i, size in enumerate(sizes):
            dtype = DTYPES[i % len(DTYPES)]
            x01, x10 = _data(size, dtype, 2 * i), _data(size, dtype, 2 * i + 1)
            m01, m10 = await asyncio.gather(_exchange(t0, t1, [x01], [i]),
                                            _exchange(t1, t0, [x10], [i]))
            for x, (m,) in ((x01, m01), (x10, m10)):
                h = m.header
                _expect(h.length == x.nbytes and len(m.payload) == x.nbytes,
                        f"{size} B of {dtype}: got {len(m.payload)} bytes, header {h.length}")
                _expect(h.dtype == dtype_to_wire(x.dtype) and tuple(h.shape) == x.shape,
                        f"{size} B of {dtype}: header says {h.dtype} {h.shape}")
                _expect(_same(x, m.payload), f"{size} B of {dtype}: payload differs")


@_check
async def check_recv_after_arrival(make_pair: MakePair, max_size: int) -> None:
    """Receives posted after their messages arrived get them (into a buffer, or a new one)."""
    sizes = [s for s in (8, 100_000, 2 * MiB, 0) if s <= max_size]
    async with make_pair() as (t0, t1):
        xs = [_data(s, seed=s) for s in sizes]
        sends = [t0.post_send(1, _header(0, tag, x), x) for tag, x in enumerate(xs)]
        await _within(asyncio.gather(*sends), "sends")
        await _arrived(t1, len(xs))
        for tag, x in enumerate(xs):
            buf = np.empty_like(x) if tag % 2 == 0 else None
            m = await _within(t1.post_recv(0, SCHED, 0, tag, buf), f"receive of tag {tag}")
            _expect(_same(x, m.payload), f"tag {tag} ({x.nbytes} B): payload differs")


@_check
async def check_unknown_length(make_pair: MakePair, max_size: int) -> None:
    """``buf=None`` receives a payload of any length, posted before or after arrival."""
    sizes = [s for s in (0, 5, MiB + 1) if s <= max_size]
    async with make_pair() as (t0, t1):
        xs = [_data(s, seed=10 + s) for s in sizes]
        early = [t1.post_recv(0, SCHED, 0, tag, None) for tag in range(len(xs))]
        for tag, x in enumerate(xs):
            t0.post_send(1, _header(0, tag, x), x)
        later = [t0.post_send(1, _header(0, 100 + tag, x), x) for tag, x in enumerate(xs)]
        await _within(asyncio.gather(*later), "sends")
        msgs = await _within(asyncio.gather(*early), "receives posted before arrival")
        await _arrived(t1, len(xs))
        for tag in range(len(xs)):
            msgs.append(await _within(t1.post_recv(0, SCHED, 0, 100 + tag, None),
                                      "receive posted after arrival"))
        for m, x in zip(msgs, xs + xs, strict=True):
            _expect(m.header.length == x.nbytes and len(m.payload) == x.nbytes,
                    f"unknown-length receive got {len(m.payload)} bytes, expected {x.nbytes}")
            _expect(_same(x, m.payload), f"unknown-length receive of {x.nbytes} B differs")


@_check
async def check_same_key_order(make_pair: MakePair, max_size: int) -> None:
    """Frames with one key are delivered in send order, small ones never overtaking large."""
    pattern = [s for s in (8, 300_000, 2 * MiB, 0, 17) if s <= max_size]
    async with make_pair() as (t0, t1):
        for round_, post_first in enumerate((True, False)):
            tag = 5 + round_
            xs = [np.full(pattern[i % len(pattern)], i % 251, np.uint8) for i in range(40)]
            cap = max(pattern)
            recvs = ([t1.post_recv(0, SCHED, 0, tag, np.empty(cap, np.uint8)) for _ in xs]
                     if post_first else [])
            sends = [t0.post_send(1, _header(0, tag, x), x) for x in xs]
            await _within(asyncio.gather(*sends), "sends")
            if not post_first:
                await _arrived(t1, len(xs))
                recvs = [t1.post_recv(0, SCHED, 0, tag, None) for _ in xs]
            msgs = await _within(asyncio.gather(*recvs), "receives")
            for i, (x, m) in enumerate(zip(xs, msgs, strict=True)):
                _expect(len(m.payload) == x.nbytes and _same(x, m.payload),
                        f"same-key message {i} (posted {'before' if post_first else 'after'} "
                        f"arrival) is out of order or corrupt")


@_check
async def check_tags_out_of_order(make_pair: MakePair, max_size: int) -> None:
    """Receives on different tags match their own frames whatever the posting order."""
    async with make_pair() as (t0, t1):
        xs = [_data(64 + 1000 * i, seed=i) for i in range(50)]
        recvs = {tag: t1.post_recv(0, SCHED, 0, tag, np.empty_like(xs[tag]))
                 for tag in reversed(range(25))}
        sends = [t0.post_send(1, _header(0, tag, x), x) for tag, x in enumerate(xs)]
        await _within(asyncio.gather(*sends), "sends")
        await _arrived(t1, 25)
        order = np.random.default_rng(3).permutation(np.arange(25, 50))
        for tag in order:
            recvs[int(tag)] = t1.post_recv(0, SCHED, 0, int(tag), None)
        for tag, fut in recvs.items():
            m = await _within(fut, f"receive of tag {tag}")
            _expect(m.header.tag == tag and _same(xs[tag], m.payload),
                    f"tag {tag} got the payload of another frame")


@_check
async def check_self_send(make_pair: MakePair, max_size: int) -> None:
    """A rank sends to itself; receives posted before and after both work."""
    async with make_pair() as (t0, t1):
        for t in (t0, t1):
            x, y = _data(1000, "float32", t.rank), _data(min(MiB, max_size), seed=9)
            r = t.post_recv(t.rank, SCHED, 0, 1, np.empty_like(x))
            await _within(t.post_send(t.rank, _header(t.rank, 1, x), x), "self-send")
            await _within(t.post_send(t.rank, _header(t.rank, 2, y), y), "self-send")
            m1 = await _within(r, "self-receive posted before")
            m2 = await _within(t.post_recv(t.rank, SCHED, 0, 2, None), "self-receive after")
            _expect(_same(x, m1.payload) and _same(y, m2.payload), "self-send payload differs")


@_check
async def check_many_concurrent(make_pair: MakePair, max_size: int) -> None:
    """500 messages each way at once, mixed sizes, receives posted in random order."""
    rng = np.random.default_rng(11)
    choices = [s for s in (0, 8, 1000, 65536, 262144) if s <= max_size]
    async with make_pair() as (t0, t1):
        async def one_way(a: Transport, b: Transport, seed: int) -> None:
            xs = [_data(int(rng.choice(choices)), seed=seed + i) for i in range(500)]
            tags = rng.permutation(len(xs))
            before = {int(tag): b.post_recv(a.rank, SCHED, 0, int(tag), None)
                      for tag in tags[:250]}
            sends = [a.post_send(b.rank, _header(a.rank, tag, x), x) for tag, x in enumerate(xs)]
            after = {int(tag): b.post_recv(a.rank, SCHED, 0, int(tag), np.empty_like(xs[tag]))
                     for tag in tags[250:]}
            await _within(asyncio.gather(*sends), f"500 sends {a.rank}->{b.rank}")
            for tag, fut in (before | after).items():
                m = await _within(fut, f"receive of tag {tag}")
                _expect(_same(xs[tag], m.payload), f"{a.rank}->{b.rank} tag {tag} differs")
        await asyncio.gather(one_way(t0, t1, 0), one_way(t1, t0, 10_000))


@_check
async def check_large_does_not_stall_small(make_pair: MakePair, max_size: int) -> None:
    """A small frame sent after a large one on another key is delivered while the large one's
    receive is not even posted."""
    big = _data(min(64 * MiB, max_size), seed=1)
    small = _data(8, seed=2)
    async with make_pair() as (t0, t1):
        sent_big = t0.post_send(1, _header(0, 1, big), big)
        sent_small = t0.post_send(1, _header(0, 2, small), small)
        m = await _within(t1.post_recv(0, SCHED, 0, 2, None), "small receive behind a large one")
        _expect(_same(small, m.payload), "small payload differs")
        await _within(asyncio.gather(sent_big, sent_small), "sends")
        m = await _within(t1.post_recv(0, SCHED, 0, 1, np.empty_like(big)), "large receive")
        _expect(_same(big, m.payload), "large payload differs")


@_check
async def check_post_frame(make_pair: MakePair, max_size: int) -> None:
    """``post_frame`` builds the header: this rank as source, the protocol version, the kind,
    key, dtype, shape and format given, the payload's length; to a peer and to oneself."""
    async with make_pair() as (t0, t1):
        x = _data(min(40_000, max_size), "float32", 5)
        for dst, execution in ((1, 3), (0, 4)):
            dest = t1 if dst == 1 else t0
            r = dest.post_recv(0, SCHED, execution, 11, np.empty_like(x))
            sent = t0.post_frame(dst, int(Kind.ACTIVATION), SCHED, execution, 11,
                                 x.view(np.uint8).data, dtype_to_wire(x.dtype), x.shape,
                                 int(Format.DENSE))
            await _within(sent, f"post_frame to rank {dst}")
            m = await _within(r, f"receive of a post_frame to rank {dst}")
            want = Header(PROTOCOL_VERSION, int(Kind.ACTIVATION), SCHED, execution, 11, 0,
                          dtype_to_wire(x.dtype), x.shape, int(Format.DENSE), x.nbytes)
            _expect(tuple(m.header) == tuple(want),
                    f"post_frame to rank {dst}: header {tuple(m.header)}, expected {want}")
            _expect(_same(x, m.payload), f"post_frame to rank {dst}: payload differs")
        r = t1.post_recv(0, SCHED, 0, 12, None)
        await _within(t0.post_frame(1, int(Kind.DATA), SCHED, 0, 12, b"", fmt=int(Format.RAW)),
                      "empty post_frame")
        m = await _within(r, "receive of an empty post_frame")
        _expect(m.header.length == 0 and len(m.payload) == 0 and m.header.dtype == ""
                and tuple(m.header.shape) == (), f"empty post_frame arrived as {m.header}")


@_check
async def check_close_fails_pending(make_pair: MakePair, max_size: int) -> None:
    """``close()`` fails pending receives with TransportClosedError; pending sends finish or
    fail with it; nothing hangs."""
    big = _data(min(16 * MiB, max_size), seed=4)
    async with make_pair() as (_t0, t1):
        r1 = t1.post_recv(0, SCHED, 0, 1, np.empty(16, np.uint8))
        r2 = t1.post_recv(1, SCHED, 0, 2, None)
        s = t1.post_send(0, _header(1, 3, big), big)
        await t1.close()
        await _fails_with(r1, TransportClosedError, "receive from the peer after close()", 2.0)
        await _fails_with(r2, TransportClosedError, "receive from oneself after close()", 2.0)
        try:
            await asyncio.wait_for(s, 2.0)
        except TransportClosedError:
            pass
        except asyncio.TimeoutError:
            raise AssertionError("send pending at close() still pending 2 s later") from None


@_check
async def check_post_after_close(make_pair: MakePair, max_size: int) -> None:
    """After ``close()`` posts fail with TransportClosedError and close() is idempotent."""
    x = _data(8)
    async with make_pair() as (t0, t1):
        await t0.close()
        await _post_fails(lambda: t0.post_recv(1, SCHED, 0, 1, None), TransportClosedError,
                          "post_recv after close()")
        await _post_fails(lambda: t0.post_send(1, _header(0, 1, x), x), TransportClosedError,
                          "post_send after close()")
        await _post_fails(lambda: t0.post_send(0, _header(0, 1, x), x), TransportClosedError,
                          "self post_send after close()")
        await _post_fails(lambda: t0.post_frame(1, int(Kind.DATA), SCHED, 0, 1, x),
                          TransportClosedError, "post_frame after close()")
        await _within(t0.close(), "second close()")
        await _fails_with(t0.listen(), TransportClosedError, "listen() after close()")
        await _fails_with(t0.connect({1: t1.address}), TransportClosedError,
                          "connect() after close()")


@_check
async def check_peer_close(make_pair: MakePair, max_size: int) -> None:
    """A peer's close fails pending and later receives from it with PeerLostError naming it;
    sends to it fail too; the survivor carries on with the others (here: itself)."""
    x = _data(64)
    async with make_pair() as (t0, t1):
        r1 = t0.post_recv(1, SCHED, 0, 1, np.empty(64, np.uint8))
        r2 = t0.post_recv(1, SCHED, 0, 2, None)
        await t1.close()
        for r in (r1, r2):
            exc = await _fails_with(r, PeerLostError, "pending receive from a closed peer", 2.0)
            _expect(getattr(exc, "rank", None) == 1, f"PeerLostError names rank "
                    f"{getattr(exc, 'rank', None)}, expected 1")
        await _post_fails(lambda: t0.post_recv(1, SCHED, 0, 3, None), PeerLostError,
                          "post_recv from a lost peer")
        await _post_fails(lambda: t0.post_send(1, _header(0, 4, x), x), PeerLostError,
                          "post_send to a lost peer")
        r = t0.post_recv(0, SCHED, 0, 5, None)
        await _within(t0.post_send(0, _header(0, 5, x), x), "self-send after losing a peer")
        m = await _within(r, "self-receive after losing a peer")
        _expect(_same(x, m.payload), "self-send after losing a peer differs")


@_check
async def check_bad_arguments(make_pair: MakePair, max_size: int) -> None:
    """Bad receive and send arguments raise ValueError at once, and nothing is sent: a peer out
    of range, a forged source, a short payload, a read-only or non-contiguous buffer."""
    x = _data(8)
    async with make_pair() as (t0, t1):
        cases: list[tuple[Callable[[], Any], str]] = [
            (lambda: t0.post_recv(2, SCHED, 0, 1, None), "post_recv with src out of range"),
            (lambda: t0.post_recv(-1, SCHED, 0, 1, None), "post_recv with a negative src"),
            (lambda: t0.post_recv(1, SCHED, 0, 1, bytes(8)), "post_recv into a read-only buffer"),
            (lambda: t0.post_recv(1, SCHED, 0, 1, np.zeros((4, 4))[:, 1]),
             "post_recv into a non-contiguous buffer"),
            (lambda: t0.post_send(2, _header(0, 1, x), x), "post_send with dst out of range"),
            (lambda: t0.post_send(-1, _header(0, 1, x), x), "post_send with a negative dst"),
            (lambda: t0.post_send(1, _header(1, 1, x), x), "post_send with a forged source"),
            (lambda: t0.post_send(0, _header(1, 1, x), x),
             "post_send to oneself with a forged source"),
            (lambda: t0.post_send(1, _header(0, 1, x), x[:3]), "post_send of a short payload"),
            (lambda: t0.post_frame(2, int(Kind.DATA), SCHED, 0, 1, x),
             "post_frame with dst out of range"),
            (lambda: t0.post_frame(-1, int(Kind.DATA), SCHED, 0, 1, x),
             "post_frame with a negative dst"),
            (lambda: t0.post_frame(1, int(Kind.DATA), SCHED, 0, 1, np.zeros((4, 4))[:, 1]),
             "post_frame of a non-contiguous payload"),
        ]
        for call, what in cases:
            try:
                call()
            except ValueError:
                continue
            raise AssertionError(f"{what} did not raise ValueError")
        # nothing of the refused sends arrived; a good frame on the same key still does
        r = t1.post_recv(0, SCHED, 0, 1, None)
        await _within(t0.post_send(1, _header(0, 1, x), x), "a send after refused ones")
        m = await _within(r, "the receive after refused sends")
        _expect(_same(x, m.payload), "a refused send was delivered")
        _expect(t1.matcher.held_count == 0, "a refused send is held at the receiver")


@_check
async def check_listen_twice(make_pair: MakePair, max_size: int) -> None:
    """A second ``listen()`` raises RuntimeError and leaves the transport working."""
    async with make_pair() as (t0, t1):
        for t in (t0, t1):
            address = t.address
            try:
                await _within(t.listen(), "a second listen()")
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"rank {t.rank}: a second listen() did not raise "
                                     "RuntimeError")
            _expect(t.address == address, f"rank {t.rank}: a second listen() changed the "
                    f"address from {address!r} to {t.address!r}")
        x = _data(16)
        (m,) = await _exchange(t0, t1, [x], [3])
        _expect(_same(x, m.payload), "payload differs after a refused listen()")


@_check
async def check_connect_arguments(make_pair: MakePair, max_size: int) -> None:
    """``connect`` refuses a peer rank outside ``0..P-1`` (ValueError) before connecting."""
    async with make_pair() as (t0, _t1):
        for rank in (2, -1):
            try:
                await _within(t0.connect({rank: t0.address}, timeout=1.0),
                              f"connect to rank {rank}")
            except ValueError:
                continue
            raise AssertionError(f"connect to rank {rank} did not raise ValueError")
