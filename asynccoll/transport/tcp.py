"""``tcp://HOST:PORT``: frames over one authenticated TCP connection per pair of ranks.

Runs on whichever asyncio loop is current (uvloop's included). The rank with the lower number
connects to the higher one (retrying with jittered exponential backoff inside the caller's
deadline), so two ranks never race to open two connections; each connection is full duplex.
The connection protocol (handshake, framing, zero-copy receive, chunked interleaved send) is in
:mod:`asynccoll.transport.tcp_wire`.

A connection that fails the handshake, breaks the protocol or exceeds the limits is closed with
a logged reason (logger ``asynccoll.transport``); its peer's pending operations fail with
:class:`PeerLostError` (cause chained); the process and the other peers carry on. A lost peer
stays lost: a later connection claiming its rank is refused.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    AuthenticationError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
    TransportError,
)
from . import auth
from .base import Transport, log, lost
from .frames import Header, Limits, encode_header
from .logbudget import LogBudget
from .matching import fail_quietly
from .registry import parse_address
from .tcp_wire import PeerClosed, TcpConnection

__all__ = ["TcpStats", "TcpTransport"]


#: connections a transport lets be in their handshake at once (see ``max_pending_handshakes``)
MAX_PENDING_HANDSHAKES = 128


@dataclass
class TcpStats:
    """Counters of what a :class:`TcpTransport` refused and lost (for logs and tests)."""

    connections: int = 0  #: connections that completed the handshake
    handshakes_rejected: int = 0  #: connections closed before or during the handshake
    frames_rejected: int = 0  #: authenticated connections closed for a bad frame or a limit
    peers_lost: int = 0
    reasons: deque[str] = field(default_factory=lambda: deque(maxlen=64))


class TcpTransport(Transport):
    """One rank's endpoint on ``tcp://HOST:PORT``.

    ``secret`` (at least 16 bytes) is the job's shared secret; every connection proves knowledge
    of it both ways before anything else is read. ``handshake_timeout`` bounds a connection's
    handshake (an idle or slow client is dropped after it). Errors: :class:`PeerLostError` when a
    peer cannot be reached in time, drops, or breaks the protocol; :class:`AuthenticationError`
    when a peer fails the handshake; :class:`TransportClosedError` after :meth:`close`.
    :meth:`listen` defaults to ``tcp://127.0.0.1:0`` (port 0: a free port, published in the
    address returned). :meth:`connect` dials the peers of higher rank and waits for those of
    lower rank to dial in; a rank that only dials (rank 0, say) need not listen.

    It is the :class:`~asynccoll.transport.tcp_wire.ConnectionOwner` of its connections: the
    methods under "called by connections" are theirs, not the application's.
    """

    scheme = "tcp"

    def __init__(self, rank: int, world_size: int, *, secret: bytes, limits: Limits | None = None,
                 handshake_timeout: float = 10.0,
                 max_pending_handshakes: int = MAX_PENDING_HANDSHAKES) -> None:
        super().__init__(rank, world_size, limits=limits)
        if handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be > 0, got {handshake_timeout}")
        self._secret = auth.check_secret(secret)
        self.handshake_timeout = handshake_timeout
        #: connections allowed in their handshake at once; more are closed at once (a flood
        #: of unauthenticated connections costs a bounded amount)
        self.max_pending_handshakes = max_pending_handshakes
        self.stats = TcpStats()
        self._refusals = LogBudget()
        self._server: asyncio.AbstractServer | None = None
        self._address = ""
        self._conns: dict[int, TcpConnection] = {}
        self._pending: set[TcpConnection] = set()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._lost: dict[int, PeerLostError] = {}

    @property
    def address(self) -> str:
        return self._address

    @property
    def peers(self) -> list[int]:
        """The ranks connected now."""
        return sorted(self._conns)

    async def _listen(self, address: str | None) -> str:
        # port 0 picks a free one; the address returned has the concrete port
        address = address or "tcp://127.0.0.1:0"
        host, port = _host_port(address)
        loop = asyncio.get_running_loop()
        try:
            # bind one socket: a name with several addresses (localhost: ::1 and 127.0.0.1)
            # would get a different free port on each, and only one can be published
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)
            self._server = await loop.create_server(
                lambda: TcpConnection(self, None, self._secret), str(infos[0][4][0]), port)
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        bound = self._server.sockets[0].getsockname()[1]
        self._address = f"tcp://{_join_host(host)}:{bound}"
        return self._address

    async def _connect(self, peers: Mapping[int, str], timeout: float) -> None:
        # Dial the peers of higher rank (retrying refused connections with jittered exponential
        # backoff) and wait for those of lower rank to dial in.
        deadline = asyncio.get_running_loop().time() + timeout
        jobs = []
        for rank, addr in peers.items():
            if rank > self.rank:
                jobs.append(self._dial(rank, addr, deadline, timeout))
            else:
                jobs.append(self._await_inbound(rank, deadline, timeout))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _dial(self, rank: int, addr: str, deadline: float, timeout: float) -> None:
        host, port = _host_port(addr)
        loop = asyncio.get_running_loop()
        delay = 0.005
        while rank not in self._conns:
            if self._closed:
                raise TransportClosedError("transport closed")
            if rank in self._lost:
                raise self._lost[rank]
            conn = TcpConnection(self, rank, self._secret)
            try:
                await asyncio.wait_for(loop.create_connection(_factory(conn), host, port),
                                       max(deadline - loop.time(), 0.001))
            except (OSError, asyncio.TimeoutError) as exc:
                if loop.time() + delay >= deadline:
                    raise lost(rank, f"could not connect to {addr} within {timeout} s",
                               exc) from exc
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 1.0)
                continue
            try:
                await asyncio.wait_for(asyncio.shield(conn.ready),
                                       max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError as exc:
                conn.abort(AuthenticationError(f"handshake with rank {rank} timed out"))
                raise lost(rank, f"handshake with {addr} not done within {timeout} s",
                           exc) from exc
            return

    async def _rejoin(self, peers: Mapping[int, str], timeout: float) -> list[int]:
        # A process taking a lost rank's place dials every peer, whatever its rank: a member
        # accepts it because it lost this rank (admit_rejoins). A member that has not noticed
        # the loss yet refuses ("already connected"): retried until the deadline. Nobody
        # listening at a peer's address (ECONNREFUSED: its process is gone) makes that peer
        # lost here at once; a peer that restarts too dials this one when it joins. A peer of
        # lower rank that is itself rejoining refuses a dial from above and dials this rank
        # (lower dials higher, as always), which ends the dial loop here.
        return await self._dial_every(peers, timeout, self._dial_rejoin)

    async def _dial_rejoin(self, rank: int, addr: str, deadline: float) -> bool:
        host, port = _host_port(addr)
        loop = asyncio.get_running_loop()
        delay = 0.005
        while rank not in self._conns:
            if self._closed:
                raise TransportClosedError("transport closed")
            conn = TcpConnection(self, rank, self._secret)
            try:
                # each try bounded by the handshake time: a process that is exiting may still
                # accept a connection and never answer it
                step = min(max(deadline - loop.time(), 0.001), self.handshake_timeout)
                await asyncio.wait_for(loop.create_connection(_factory(conn), host, port), step)
                await asyncio.wait_for(asyncio.shield(conn.ready),
                                       min(max(deadline - loop.time(), 0.001),
                                           self.handshake_timeout))
                return True
            except ConnectionRefusedError as exc:
                return self._rejoin_gave_up(rank, f"nobody listens at {addr}", exc)
            except (OSError, asyncio.TimeoutError, AuthenticationError, PeerLostError) as exc:
                conn.abort(AuthenticationError("rejoin dial abandoned"))
                if loop.time() + delay >= deadline:
                    return self._rejoin_gave_up(
                        rank, f"did not admit this rank within the rejoin timeout ({exc})", exc)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 0.5)
        return True

    def _rejoin_gave_up(self, rank: int, reason: str, exc: BaseException) -> bool:
        """A rejoin dial to ``rank`` failed: True if ``rank`` dialed this one meanwhile, else
        ``rank`` is lost here (its receives fail; the communicator, not made yet, learns who
        is a member from the admission) and False."""
        if rank in self._conns:
            return True
        self._lost[rank] = lost(rank, reason, exc)
        self.matcher.fail_peer(rank, self._lost[rank])
        return False

    async def _await_inbound(self, rank: int, deadline: float, timeout: float) -> None:
        if rank in self._conns:
            return
        if rank in self._lost:
            raise self._lost[rank]
        loop = asyncio.get_running_loop()
        fut = self._waiters.get(rank)
        if fut is None:
            fut = self._waiters[rank] = loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(deadline - loop.time(), 0.001))
        except asyncio.TimeoutError as exc:
            raise lost(rank, f"rank {rank} did not connect within {timeout} s", exc) from exc

    def _post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        # The future resolves when every byte is in the kernel (the buffer may be reused then).
        loop = asyncio.get_running_loop()
        conn = self._conns.get(dst)
        if conn is None:
            return _failed(loop, self._lost.get(dst) or PeerLostError(dst, "not connected"))
        fut: asyncio.Future[None] = loop.create_future()
        conn.send(fut, encode_header(header), payload)
        return fut

    def _drop_peer(self, rank: int, exc: BaseException) -> None:
        conn = self._conns.get(rank)
        if conn is not None:
            conn.abort(exc)

    async def _close(self) -> None:
        exc = TransportClosedError("transport closed")
        for conn in [*self._conns.values(), *self._pending]:
            conn.close_by_owner(exc)
        self._conns.clear()
        self._pending.clear()
        for w in self._waiters.values():
            fail_quietly(w, exc)
        self._waiters.clear()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except asyncio.TimeoutError:  # a connection still closing; it goes on its own
                pass

    # -- called by connections (the ConnectionOwner protocol of tcp_wire) --------------------
    def connection_opened(self, conn: TcpConnection) -> None:
        if len(self._pending) >= self.max_pending_handshakes:
            conn.abort(AuthenticationError(
                f"{len(self._pending)} connections already in their handshake (the limit)"))
            return
        self._pending.add(conn)

    def _vacate(self, rank: int, exc: PeerLostError) -> bool:
        if rank in self._conns:
            return False
        self._lost[rank] = exc
        self.matcher.fail_peer(rank, exc)
        return True

    def may_rejoin(self, rank: int) -> bool:
        return self.admit_rejoins and rank in self._lost

    def check_peer(self, rank: int) -> None:
        if self.closed:
            raise AuthenticationError("transport closed")
        if rank in self._conns:
            raise AuthenticationError(f"rank {rank} is already connected")
        if rank in self._lost and not self.admit_rejoins:
            if rank in self.vacant:
                raise AuthenticationError(f"rank {rank} is vacant, and this job does not admit "
                                          "new ranks")
            raise AuthenticationError(f"rank {rank} was lost, and this job does not admit "
                                      "restarted ranks (asynccoll run --max-restarts)")

    def connection_ready(self, conn: TcpConnection) -> None:
        self.check_peer(conn.peer)
        self._pending.discard(conn)
        self._conns[conn.peer] = conn
        self._peer_incarnation(conn.peer, conn.incarnation)
        self.stats.connections += 1
        if self._lost.pop(conn.peer, None) is not None:
            self._peer_joined(conn.peer)  # a new process in a lost rank's place
        w = self._waiters.pop(conn.peer, None)
        if w is not None and not w.done():
            w.set_result(None)

    def connection_closed(self, conn: TcpConnection, cause: BaseException) -> BaseException:
        self._pending.discard(conn)
        if not conn.authed:
            return cause
        if self._closed or self._conns.get(conn.peer) is not conn:
            return cause if isinstance(cause, TransportClosedError) else TransportClosedError(
                "transport closed")
        del self._conns[conn.peer]
        if isinstance(cause, PeerLostError) and cause.rank == conn.peer:
            exc = cause  # already says why (a failed write, a cancelled send)
        else:
            exc = lost(conn.peer, str(cause) or type(cause).__name__, cause)
        self._lost[conn.peer] = exc
        self.stats.peers_lost += 1
        waiting = self._peer_lost(conn.peer, exc)
        if not isinstance(conn.error, ProtocolError):  # a rejected frame was logged already
            # An orderly close (EOF, no error) is how a job ends: ranks close at different
            # times, and persistent schedules keep receives armed. Whoever awaits one of them
            # gets the PeerLostError. The kernel of a killed process also closes with EOF, so
            # the log level cannot tell a crash from an exit; the failed operations do.
            orderly = conn.error is None and isinstance(cause, PeerClosed)
            log.log(logging.INFO if orderly else logging.WARNING,
                    "tcp rank %d: lost rank %d: %s (%d receives failed)", self.rank, conn.peer,
                    exc.reason, waiting)
        return exc

    def frame_rejected(self, conn: TcpConnection, reason: str) -> None:
        self.stats.frames_rejected += 1
        self.stats.reasons.append(reason)
        log.warning("tcp rank %d: closing the connection of rank %d: %s", self.rank, conn.peer,
                    reason)

    def handshake_failed(self, conn: TcpConnection, reason: str) -> None:
        self.stats.handshakes_rejected += 1
        self.stats.reasons.append(reason)
        say, quiet = self._refusals.take(asyncio.get_running_loop().time())
        if say:  # a flood of bad connections must not flood the log too
            more = f" ({quiet} more refused, not logged)" if quiet else ""
            log.warning("tcp rank %d: refusing connection from %s: %s%s", self.rank,
                        conn.peername, reason, more)


def _factory(conn: TcpConnection) -> Callable[[], TcpConnection]:
    return lambda: conn


def _failed(loop: asyncio.AbstractEventLoop, exc: BaseException) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = loop.create_future()
    fut.set_exception(exc)
    return fut


def _host_port(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ``ValueError`` naming the address otherwise.

    >>> _host_port("tcp://127.0.0.1:5000")
    ('127.0.0.1', 5000)
    >>> _host_port("tcp://[::1]:0")
    ('::1', 0)
    """
    scheme, loc = parse_address(address)
    if scheme != "tcp":
        raise ValueError(f"address {address!r} is not a tcp:// address")
    host, sep, port = loc.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ValueError(f"address {address!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def _join_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
