"""The connection protocol of ``tcp://``: the handshake, then framed records both ways.

One :class:`TcpConnection` per connected pair of ranks, owned by a :class:`ConnectionOwner` (a
:class:`~asynccoll.transport.tcp.TcpTransport`, which this module knows only through that
protocol). It runs the handshake of :mod:`asynccoll.transport.auth` (bounded in time; nothing is
read as a frame before it succeeds) and then carries *records*, each a 12-byte prefix ``<III`` =
(header length, message id, payload bytes in this record) and then:

* header length > 0: a new message: its msgpack :class:`~asynccoll.transport.frames.Header` and the
  first piece of its payload;
* header length = 0: the next piece of the payload of the message with that id.

Payloads are sent in pieces of at most :data:`CHUNK` bytes and the pieces of the messages queued
on a connection are interleaved, so a 64 MiB payload does not hold up a small message queued
after it. Messages begin in the order they were posted, which keeps same-key frames in order.

**Receiving** uses :class:`asyncio.BufferedProtocol`: prefixes, headers and small payloads are
read into a small staging buffer; a header is validated (:func:`decode_header` with the owner's
world size and :class:`Limits`, the source must be the authenticated peer) before any of its
payload is accepted; then :meth:`Matcher.begin` names the destination and the rest of a large
payload is read straight into it (no intermediate bytes objects).

**Sending** writes from the array's own memory in pieces of :data:`CHUNK` bytes with the
transport's write buffer limited to one piece; a send's future resolves once its last byte has
been handed to the kernel, after which the caller may reuse the buffer. Payloads up to
:data:`SMALL` bytes are copied into their record. The first small message of a loop turn is
written at once (no added latency); the small messages that follow it to the same peer in the
same turn are coalesced and written together at the end of the turn, one system call for all
of them (and, at the receiver, usually one wake-up).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from typing import Protocol, cast

from ..errors import AuthenticationError, PeerLostError, ProtocolError, TransportError
from . import auth
from .frames import Header, Limits, decode_header
from .matching import Matcher, Slot, fail_quietly

__all__ = ["CHUNK", "SMALL", "ConnectionOwner", "PeerClosed", "TcpConnection"]

_RECORD = struct.Struct("<III")  # header length (0: continuation), message id, payload bytes
CHUNK = 1 << 20  #: largest payload piece per record
SMALL = 1 << 16  #: payloads up to this size are copied into their record's single write
_DIRECT = 1 << 16  # payload pieces at least this long are read straight into the destination
_MAX_ACTIVE = 32  # messages a sender interleaves at once on one connection
#: the receive buffer of a connection in its handshake (the largest handshake message fits)
_HANDSHAKE_BUF = 512
_MAX_INFLIGHT = 256  # messages a receiver accepts as partly received at once

# receive states
_HELLO, _CHALLENGE, _PROOF, _ACCEPT, _HEAD, _HEADER, _PAYLOAD, _DEAD = range(8)


class PeerClosed(ConnectionResetError):
    """The peer closed its end in order (EOF with no error): how a job ends, not a crash."""


class ConnectionOwner(Protocol):
    """What a :class:`TcpConnection` needs from the transport that owns it.

    The owner knows every connection (so that it can close them) and which rank each authenticated
    one belongs to; it logs and counts what the connections refuse. Its matcher charges what
    each peer makes this rank hold to one memory budget (:class:`~.matching.Matcher`).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def matcher(self) -> Matcher: ...

    @property
    def handshake_timeout(self) -> float: ...

    @property
    def incarnation(self) -> int:
        """Which process of its rank the owner is (sent in the handshake)."""
        ...

    def connection_opened(self, conn: TcpConnection) -> None:
        """``conn`` is open and starts its handshake."""

    def may_rejoin(self, rank: int) -> bool:
        """Whether a new process may take lost ``rank``'s place."""
        ...

    def check_peer(self, rank: int) -> None:
        """Raise :class:`AuthenticationError` unless a connection of ``rank`` may be admitted
        (asked before the handshake proves anything, to refuse early)."""

    def connection_ready(self, conn: TcpConnection) -> None:
        """``conn`` authenticated ``conn.peer``: it now carries that rank's frames. Raises
        :class:`AuthenticationError` to refuse it, as :meth:`check_peer`."""

    def connection_closed(self, conn: TcpConnection, cause: BaseException) -> BaseException:
        """``conn`` is closed because of ``cause``; return what its pending operations fail
        with (for an authenticated one: its peer is lost)."""

    def handshake_failed(self, conn: TcpConnection, reason: str) -> None:
        """``conn`` is closed before or during its handshake (log and count it)."""

    def frame_rejected(self, conn: TcpConnection, reason: str) -> None:
        """An authenticated ``conn`` is closed for a bad frame or a limit (log and count it)."""



class _Out:
    """One queued send."""

    __slots__ = ("fut", "head", "length", "msgid", "pos", "view")

    def __init__(self, fut: asyncio.Future[None], head: bytes, view: memoryview) -> None:
        self.fut = fut
        self.head = head
        self.view = view
        self.length = len(view)
        self.pos = 0
        self.msgid = 0


class _In:
    """One partly received message."""

    __slots__ = ("msgid", "pos", "slot")

    def __init__(self, slot: Slot, msgid: int) -> None:
        self.slot = slot
        self.msgid = msgid
        self.pos = 0


class TcpConnection(asyncio.BufferedProtocol):
    """One connection: the handshake, then records in both directions (see the module).

    ``peer``: the rank this side dials, or ``None`` for an accepted connection (the handshake
    names it). ``secret``: the job secret the handshake proves knowledge of.
    """

    def __init__(self, owner: ConnectionOwner, peer: int | None, secret: bytes) -> None:
        self.owner = owner
        self._secret = secret
        self.connector = peer is not None
        self.peer = -1 if peer is None else peer
        self.authed = False
        self.error: BaseException | None = None  # why we closed it, if we did
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tr: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._nonce_c = b""
        self._nonce_a = b""
        self._incs = (0, 0)  # the connector's and the acceptor's incarnations
        #: the peer's incarnation (which process of its rank), once authenticated
        self.incarnation = 0
        # receive side: a small buffer until the peer is authenticated (an unauthenticated
        # connection must cost little), the staging buffer after
        self._buf = bytearray(_HANDSHAKE_BUF)
        self._mv = memoryview(self._buf)
        self._grow = False
        self._fill = 0
        self._state = _CHALLENGE if self.connector else _HELLO
        self._need = auth.CHALLENGE_SIZE if self.connector else auth.HELLO_SIZE
        self._msgid = 0
        self._nbytes = 0
        self._cur: _In | None = None
        self._rem = 0
        self._direct = False  # the last get_buffer returned the destination itself
        self._exact = False  # read prefixes and headers without reading ahead
        self._inflight: dict[int, _In] = {}
        # send side
        self._queue: deque[_Out] = deque()
        self._active: deque[_Out] = deque()
        self._written: list[_Out] = []
        self._paused = False
        self._turn = True
        self._next_id = 0
        # small records that followed one already written in this loop turn (None: no record
        # left in this turn yet), written together when the turn ends
        self._burst: list[bytes] | None = None
        self._burst_outs: list[_Out] = []

    @property
    def peername(self) -> object:
        """The remote socket address (for logs), ``None`` before the connection is made."""
        return self.tr.get_extra_info("peername") if self.tr is not None else None

    # -- connection events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods
        tr = self.tr = cast(asyncio.Transport, transport)
        sock = tr.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # not every socket family has the option; latency only
                pass
        # High-water mark 0: a write that the kernel does not take in full pauses us, and
        # resume_writing comes when the buffer is empty, i.e. when every byte is in the kernel.
        tr.set_write_buffer_limits(high=0, low=0)
        self.owner.connection_opened(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.owner.handshake_timeout, self._handshake_expired)
        if self.connector:
            self._nonce_c = auth.new_nonce()
            tr.write(auth.make_hello(self.owner.rank, self.owner.world_size, self.peer,
                                     self._nonce_c, self.owner.incarnation))

    def connection_lost(self, exc: Exception | None) -> None:
        was = self._state
        self._state = _DEAD
        if self._timer is not None:
            self._timer.cancel()
        cause: BaseException = self.error or exc or PeerClosed("connection closed by the peer")
        failure = self.owner.connection_closed(self, cause)
        if not self.authed:
            if self.error is None:
                self.owner.handshake_failed(
                    self, f"connection closed during the handshake (state {was})")
            if not self.ready.done():
                err = cause if isinstance(cause, TransportError) else AuthenticationError(
                    f"rank {self.peer} closed the connection during the handshake "
                    "(wrong secret or refused)")
                if err is not cause:
                    err.__cause__ = cause
                fail_quietly(self.ready, err)
            return
        self._fail_all(failure)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._confirm()
        self._pump()

    # -- receiving ---------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _PAYLOAD and self._rem >= _DIRECT:
            cur = self._cur
            assert cur is not None
            self._direct = True
            return cur.slot.view[cur.pos: cur.pos + self._rem]
        self._direct = False
        if self._exact and self._state in (_HEAD, _HEADER):
            # after a large piece another is likely: read only its prefix and header, so that
            # its payload lands in the destination rather than being copied from staging
            return self._mv[self._fill: self._need]
        return self._mv[self._fill:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _DEAD:
            self._fill = 0
            return
        try:
            if self._direct:
                cur = self._cur
                assert cur is not None
                cur.pos += nbytes
                self._rem -= nbytes
                if not self._rem:
                    self._exact = True
                    self._end_record()
                return
            self._fill += nbytes
            self._parse()
        except (ProtocolError, AuthenticationError) as exc:
            self.abort(exc)

    def _parse(self) -> None:
        mv = self._mv
        p, end = 0, self._fill
        matcher = self.owner.matcher
        while p < end:
            if self._state == _HEAD and end - p > _RECORD.size:
                # fast path: a whole message (prefix, header, payload) is in the buffer
                hlen, msgid, nbytes = _RECORD.unpack_from(mv, p)
                q = p + _RECORD.size + hlen
                if 0 < hlen <= self.owner.limits.max_header_bytes and q + nbytes <= end:
                    self._msgid, self._nbytes = msgid, nbytes
                    h = decode_header(mv[p + _RECORD.size: q], self.owner.world_size,
                                      self.owner.limits)
                    if nbytes == h.length:
                        self._exact = False
                        self._check_header(h)
                        slot = matcher.begin(h)
                        if nbytes:
                            slot.view[:nbytes] = mv[q: q + nbytes]
                        matcher.complete(slot)
                        p = q + nbytes
                        continue
                    self._on_header(h)
                    p = q
                    continue
            if self._state == _PAYLOAD:
                cur = self._cur
                assert cur is not None
                k = min(self._rem, end - p)
                cur.slot.view[cur.pos: cur.pos + k] = mv[p: p + k]
                cur.pos += k
                self._rem -= k
                p += k
                if not self._rem:
                    self._end_record()
                continue
            need = self._need
            if end - p < need:
                break
            self._on_fixed(mv[p: p + need])
            p += need
            if self._state == _DEAD:
                self._fill = 0
                return
            if self._grow:  # just authenticated: move what is left into the staging buffer
                self._grow = False
                size = max(1 << 18, 4 * (self.owner.limits.max_header_bytes + _RECORD.size))
                big = bytearray(size)
                big[:end - p] = mv[p:end]
                self._buf, self._mv = big, memoryview(big)
                mv, end, p = self._mv, end - p, 0
        left = end - p
        if left and p:
            self._buf[:left] = self._buf[p:end]
        self._fill = left

    def _on_fixed(self, chunk: memoryview) -> None:
        st = self._state
        if st == _HEAD:
            hlen, self._msgid, self._nbytes = _RECORD.unpack(chunk)
            if hlen:
                if hlen > self.owner.limits.max_header_bytes:
                    raise ProtocolError(f"header of {hlen} bytes exceeds "
                                        f"{self.owner.limits.max_header_bytes}")
                self._state, self._need = _HEADER, hlen
                return
            cur = self._inflight.get(self._msgid)
            if cur is None:
                raise ProtocolError(f"continuation of unknown message id {self._msgid}")
            if not self._nbytes or cur.pos + self._nbytes > cur.slot.header.length:
                raise ProtocolError(
                    f"continuation of {self._nbytes} bytes at offset {cur.pos} of a "
                    f"{cur.slot.header.length}-byte message")
            self._start_payload(cur)
        elif st == _HEADER:
            self._on_header(decode_header(chunk, self.owner.world_size, self.owner.limits))
        else:
            self._on_handshake(st, chunk)

    def _check_header(self, h: Header) -> None:
        if h.src != self.peer:
            raise ProtocolError(f"frame claims source rank {h.src} on the connection of "
                                f"rank {self.peer}")
        if self._nbytes > h.length:
            raise ProtocolError(f"record carries {self._nbytes} bytes of a {h.length}-byte "
                                "payload")
        if self._msgid in self._inflight:
            raise ProtocolError(f"message id {self._msgid} is already being received")

    def _on_header(self, h: Header) -> None:
        self._check_header(h)
        if len(self._inflight) >= _MAX_INFLIGHT:
            raise ProtocolError(f"more than {_MAX_INFLIGHT} messages partly received")
        o = self.owner
        cur = _In(o.matcher.begin(h), self._msgid)
        if not h.length:
            o.matcher.complete(cur.slot)
            self._state, self._need = _HEAD, _RECORD.size
            return
        self._inflight[self._msgid] = cur
        if self._nbytes:
            self._start_payload(cur)
        else:
            self._state, self._need = _HEAD, _RECORD.size

    def _start_payload(self, cur: _In) -> None:
        self._cur = cur
        self._rem = self._nbytes
        self._state = _PAYLOAD
        if self._rem < _DIRECT:
            self._exact = False

    def _end_record(self) -> None:
        cur = self._cur
        assert cur is not None
        self._cur = None
        self._state, self._need = _HEAD, _RECORD.size
        if cur.pos == cur.slot.header.length:
            del self._inflight[cur.msgid]
            self.owner.matcher.complete(cur.slot)

    def _on_handshake(self, st: int, chunk: memoryview) -> None:
        o = self.owner
        tr = self.tr
        assert tr is not None
        if st == _HELLO:
            hello = auth.parse_hello(chunk)
            self.peer = hello.rank
            if hello.world_size != o.world_size:
                raise AuthenticationError(f"peer has world size {hello.world_size}, "
                                          f"this rank {o.world_size}")
            if 0 <= hello.rank < o.world_size and hello.rank != o.rank:
                o.check_peer(hello.rank)  # says why first: connected already, lost for good
            if not 0 <= hello.rank < o.world_size or hello.rank == o.rank \
                    or hello.wanted != o.rank \
                    or (hello.rank > o.rank and not o.may_rejoin(hello.rank)):
                raise AuthenticationError(
                    f"peer claims rank {hello.rank} and wants rank {hello.wanted}; rank "
                    f"{o.rank} accepts connections from lower ranks only (and from a process "
                    "taking a lost or vacant rank's place, when rejoins are admitted)")
            o.check_peer(hello.rank)
            self._nonce_c = hello.nonce
            self._nonce_a = auth.new_nonce()
            self._incs = (hello.incarnation, o.incarnation)
            mac = auth.acceptor_mac(self._secret, self.peer, o.rank, o.world_size, self._nonce_c,
                                    self._nonce_a, self._incs)
            tr.write(auth.make_challenge(o.rank, o.world_size, self._nonce_a, mac,
                                         o.incarnation))
            self._state, self._need = _PROOF, auth.PROOF_SIZE
        elif st == _CHALLENGE:
            ch = auth.parse_challenge(chunk)
            if ch.rank != self.peer or ch.world_size != o.world_size:
                raise AuthenticationError(
                    f"expected rank {self.peer} of {o.world_size}, reached rank {ch.rank} of "
                    f"{ch.world_size}")
            self._nonce_a = ch.nonce
            self._incs = (o.incarnation, ch.incarnation)
            auth.verify(auth.acceptor_mac(self._secret, o.rank, self.peer, o.world_size,
                                          self._nonce_c, self._nonce_a, self._incs), ch.mac,
                        f"rank {self.peer}")
            tr.write(auth.connector_mac(self._secret, o.rank, self.peer, o.world_size,
                                        self._nonce_c, self._nonce_a, self._incs))
            self._state, self._need = _ACCEPT, auth.ACCEPT_SIZE
        elif st == _PROOF:
            auth.verify(auth.connector_mac(self._secret, self.peer, o.rank, o.world_size,
                                           self._nonce_c, self._nonce_a, self._incs), chunk,
                        f"connection claiming rank {self.peer}")
            # Refuse before accepting, and accept before the connection is the peer's: its
            # owner's listeners may send on it at once (a joining rank says "ready" to a rank
            # that came back), and a frame ahead of ACCEPT reads as a refusal to the dialer.
            o.check_peer(self.peer)
            tr.write(auth.ACCEPT)
            self._ready()
            self._authenticated()
        elif st == _ACCEPT:
            if bytes(chunk) != auth.ACCEPT:
                raise AuthenticationError(f"rank {self.peer} did not accept the handshake")
            self._ready()
            self._authenticated()

    def _ready(self) -> None:
        # the peer's incarnation: the connector's on the accepting side, and the other way
        self.incarnation = self._incs[0] if not self.connector else self._incs[1]
        self.owner.connection_ready(self)
        self.authed = True

    def _authenticated(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._grow = True
        self._state, self._need = _HEAD, _RECORD.size
        if not self.ready.done():
            self.ready.set_result(None)

    def _handshake_expired(self) -> None:
        if not self.authed and self._state != _DEAD:
            self.abort(AuthenticationError(
                f"handshake not completed within {self.owner.handshake_timeout} s"))

    # -- sending -----------------------------------------------------------------------------
    def send(self, fut: asyncio.Future[None], head: bytes, view: memoryview) -> None:
        if (len(view) <= SMALL and not self._paused and not self._queue and not self._active
                and self._state != _DEAD):
            # fast path: nothing queued ahead, so the whole frame goes out in one write
            tr = self.tr
            assert tr is not None
            msgid = self._next_id
            self._next_id = (msgid + 1) & 0xFFFFFFFF
            rec = _RECORD.pack(len(head), msgid, len(view)) + head + view
            if self._burst is not None:  # not the first of this turn: coalesce
                self._burst.append(rec)
                self._burst_outs.append(_Out(fut, head, view))
                return
            try:
                tr.write(rec)
            except (RuntimeError, OSError) as exc:
                self._written.append(_Out(fut, head, view))
                self._broken(exc)
                return
            self._burst = []
            asyncio.get_running_loop().call_soon(self._end_burst)
            if self._paused:
                self._written.append(_Out(fut, head, view))
            else:
                fut.set_result(None)
            return
        self._flush_burst()  # what was coalesced goes first: messages begin in posting order
        self._queue.append(_Out(fut, head, view))
        if not self._paused:
            self._pump()

    def _end_burst(self) -> None:
        self._flush_burst()
        self._burst = None

    def _flush_burst(self) -> None:
        recs, outs = self._burst, self._burst_outs
        if not recs:
            return
        self._burst, self._burst_outs = [], []
        if self._state == _DEAD:
            for out in outs:
                fail_quietly(out.fut, self.error or PeerLostError(self.peer, "connection closed"))
            return
        tr = self.tr
        assert tr is not None
        try:
            tr.write(b"".join(recs))
        except (RuntimeError, OSError) as exc:
            self._written.extend(outs)
            self._broken(exc)
            return
        if self._paused:
            self._written.extend(outs)
        else:
            for out in outs:
                if not out.fut.done():
                    out.fut.set_result(None)

    def _pump(self) -> None:
        try:
            self._pump_writes()
        except (RuntimeError, OSError) as exc:
            self._broken(exc)

    def _broken(self, exc: BaseException) -> None:
        # a write raised: the transport closed under us (uvloop raises where asyncio drops)
        err = PeerLostError(self.peer, f"write failed: {exc}")
        err.__cause__ = exc
        self.abort(err)

    def _pump_writes(self) -> None:
        tr = self.tr
        assert tr is not None
        queue, active = self._queue, self._active
        while not self._paused and (queue or active) and self._state != _DEAD:
            # alternate between starting a queued message and continuing a started one
            if queue and len(active) < _MAX_ACTIVE and (self._turn or not active):
                self._turn = False
                out = queue.popleft()
                if out.fut.done():  # cancelled before any byte went out
                    continue
                out.msgid = self._next_id
                self._next_id = (self._next_id + 1) & 0xFFFFFFFF
                self._written.append(out)  # so that a failing write below fails it too
                n = min(out.length, CHUNK)
                rec = _RECORD.pack(len(out.head), out.msgid, n) + out.head
                if n <= SMALL:
                    tr.write(rec + out.view[:n])
                else:
                    tr.write(rec)
                    tr.write(out.view[:n])
                out.pos = n
                if out.pos < out.length:
                    self._written.pop()
                    active.append(out)
            else:
                self._turn = True
                out = active[0]
                if out.fut.done():
                    # cancelled half-sent: the stream cannot be resynchronised
                    self.abort(PeerLostError(self.peer, "a send was cancelled half-way"))
                    return
                n = min(out.length - out.pos, CHUNK)
                tr.write(_RECORD.pack(0, out.msgid, n))
                tr.write(out.view[out.pos: out.pos + n])
                out.pos += n
                active.popleft()
                if out.pos < out.length:
                    active.append(out)
                else:
                    self._written.append(out)
        if not self._paused:
            self._confirm()

    def _confirm(self) -> None:
        """Resolve the sends whose every byte is in the kernel (the write buffer is empty)."""
        if self._written:
            done, self._written = self._written, []
            for out in done:
                if not out.fut.done():
                    out.fut.set_result(None)

    # -- failure -----------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Close at once because of ``exc`` (logged; counted in the owner's stats)."""
        if self._state == _DEAD or self.error is not None:
            return
        self.error = exc
        if not self.authed:
            self.owner.handshake_failed(self, str(exc))
        elif isinstance(exc, ProtocolError):
            self.owner.frame_rejected(self, str(exc))
        self._state = _DEAD
        if self.tr is not None:
            self.tr.abort()

    def close_by_owner(self, exc: BaseException) -> None:
        """Our transport is closing: fail what is pending here with ``exc`` and close."""
        self.error = self.error or exc
        self._state = _DEAD
        if self._timer is not None:
            self._timer.cancel()
        self._fail_all(exc)
        fail_quietly(self.ready, exc)
        if self.tr is not None:
            self.tr.close()

    def _fail_all(self, exc: BaseException) -> None:
        for cur in self._inflight.values():
            self.owner.matcher.abandon(cur.slot)
            if cur.slot.posted is not None:
                fail_quietly(cur.slot.posted.fut, exc)
        self._inflight.clear()
        self._cur = None
        for q in (self._queue, self._active, self._written, self._burst_outs):
            for out in q:
                fail_quietly(out.fut, exc)
        self._burst_outs = []
        if self._burst:
            self._burst = []
        self._queue.clear()
        self._active.clear()
        self._written = []
