"""The transport interface the schedule engine uses.

A message is a **frame** (:mod:`.frames`: a small msgpack header followed by ``length`` payload
bytes). Frames are matched to receives by ``(source, schedule id, execution, tag)`` in
:class:`~.matching.Matcher`, shared by every transport, so that inproc, tcp and ucx behave the
same. A concrete transport only moves bytes: it asks the matcher where a payload goes
(:meth:`~.matching.Matcher.begin`), writes it there, and says so
(:meth:`~.matching.Matcher.complete`).

The interface validates once. The public methods of :class:`Transport` check their arguments and
the transport's state, then call the backend's private hooks (``_listen``, ``_connect``,
``_post_send``, ``_post_recv``, ``_close``), so that no backend can accept what another refuses:

* a peer (``dst``, ``src``, a key of ``connect``'s ``peers``) outside ``0..P-1``: ``ValueError``
  naming the argument;
* a header whose source is not this rank (a forged source): ``ValueError``;
* a payload shorter than ``header.length``: ``ValueError``;
* a second :meth:`~Transport.listen`: ``RuntimeError``;
* anything after :meth:`~Transport.close`: :class:`TransportClosedError` (raised by the
  coroutines, carried by the futures of the posting methods).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, ClassVar

from ..buffers import as_bytes
from ..errors import PeerLostError, ProtocolError, TransportClosedError, TransportError
from .frames import PROTOCOL_VERSION, Format, Header, Limits, Message
from .liveness import Liveness
from .matching import Matcher, Slot

__all__ = ["Transport", "lost"]

log = logging.getLogger("asynccoll.transport")

_DENSE = int(Format.DENSE)


class Transport(abc.ABC):
    """Point-to-point messaging for one rank.

    Lifecycle: ``await listen()`` (returns the address to publish), ``await connect(peers)``,
    then any number of :meth:`post_frame` / :meth:`post_send` / :meth:`post_recv`, then
    ``await close()``.

    The posting methods return at once with a future, so that the engine needs no task per
    message. A send's future resolves when its payload buffer may be reused (the bytes are
    with the transport or the peer), or fails with :class:`PeerLostError` /
    :class:`TransportClosedError`. A cancelled send may already have sent part of its frame;
    the connection is then closed, since the stream cannot be resynchronised. Bad arguments
    raise at once (see the module docstring); a closed transport fails the returned future.

    ``supports_device``: whether payloads and receive buffers may be device (CuPy) arrays;
    otherwise the caller stages them through host memory. ``matcher``: the receive matcher
    (its counters, :attr:`~.matching.Matcher.held_count` and friends, are for tests and
    diagnostics).
    """

    scheme: ClassVar[str]
    supports_device: ClassVar[bool] = False

    def __init__(self, rank: int, world_size: int, *, limits: Limits | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.limits = limits or Limits()
        self.matcher = Matcher(rank, self.limits, world_size)
        self.matcher.on_drop = self._drop_peer
        self._listening = False
        self._closed = False
        self._loss_listeners: list[Callable[[int, PeerLostError], None]] = []
        self._join_listeners: list[Callable[[int], None]] = []
        self._liveness: Liveness | None = None
        #: whether a new process may take a lost rank's place (it proves the job's secret and
        #: claims the rank; :meth:`rejoin`). Off by default: the communicator turns it on when
        #: its partial collectives survive losses (``survive``), where a restarted rank can be
        #: admitted again (docs/groups.md, "Joining").
        self.admit_rejoins = False
        #: which process of its rank this one is: 0 for the first, k for its k-th restart
        #: (``ASYNCCOLL_RESTART``; set before :meth:`listen`). Sent in the handshake.
        self.incarnation = 0
        self._incarnations: dict[int, int] = {}  # per peer: its connected process's
        #: the ranks of the job's capacity that no process has held yet (:meth:`vacate`)
        self.vacant: set[int] = set()
        #: the vacant ranks a process took since (:meth:`_peer_joined`)
        self.taken: set[int] = set()

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address peers connect to (valid after :meth:`listen`)."""

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    def on_peer_lost(self, callback: Callable[[int, PeerLostError], None]) -> None:
        """Call ``callback(rank, error)`` on the transport's loop each time a connected peer
        is lost (its connection broke or closed; the transport cannot tell a crash from an
        exit, the layer above can). Not called for losses after :meth:`close`."""
        self._loss_listeners.append(callback)

    def off_peer_lost(self, callback: Callable[[int, PeerLostError], None]) -> None:
        """Stop calling ``callback`` (:meth:`on_peer_lost`); ``ValueError`` if it was not
        there."""
        self._loss_listeners.remove(callback)

    def on_peer_joined(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(rank)`` on the transport's loop each time a new process took the
        place of lost ``rank`` (:attr:`admit_rejoins`): its frames are matched afresh from
        then on."""
        self._join_listeners.append(callback)

    def off_peer_joined(self, callback: Callable[[int], None]) -> None:
        """Stop calling ``callback`` (:meth:`on_peer_joined`)."""
        self._join_listeners.remove(callback)

    def incarnation_of(self, rank: int) -> int:
        """Which process of ``rank`` this transport is connected to, or last was (its
        :attr:`incarnation`, from the handshake; 0 before any). A loss notice about an
        incarnation below it is about a process that a restart already replaced."""
        return self._incarnations.get(rank, 0)

    def _peer_incarnation(self, rank: int, incarnation: int) -> None:
        """For the backends: an authenticated connection to ``rank``'s process
        ``incarnation``."""
        self._incarnations[rank] = incarnation

    def vacate(self, ranks: Iterable[int]) -> None:
        """Ranks of a job that may grow (``asynccoll run --nnodes MIN:MAX``) that no process
        holds yet: lost here from the start, without a word to anyone (nobody lost them), so
        that a process given one later connects as a restarted rank does (:meth:`rejoin`;
        admitted when :attr:`admit_rejoins`). Call before :meth:`connect` returns to the
        communicator; on the transport's loop."""
        for r in ranks:
            if not 0 <= r < self.world_size or r == self.rank:
                raise ValueError(f"vacate: rank must be another rank in "
                                 f"0..{self.world_size - 1}, got {r}")
            if self._vacate(r, lost(r, "no process holds this rank yet (the job may grow "
                                       "into it)")):
                self.vacant.add(r)

    def _vacate(self, rank: int, exc: PeerLostError) -> bool:
        """The backend's part of :meth:`vacate`: unless a process of ``rank`` is connected
        already (one that joined while this one met the others), ``rank``'s receives fail
        with ``exc`` and True."""
        self.matcher.fail_peer(rank, exc)
        return True

    def _peer_joined(self, rank: int) -> None:
        """For the backends: a new process is connected as lost (or vacant) ``rank``."""
        if rank in self.vacant:
            self.vacant.discard(rank)
            self.taken.add(rank)
        self.matcher.readmit(rank)
        log.info("rank %d: a new process took the place of lost rank %d", self.rank, rank)
        for cb in list(self._join_listeners):
            try:
                cb(rank)
            except Exception:  # a listener's bug must not break the transport
                log.exception("rank %d: a peer-join listener failed", self.rank)

    async def rejoin(self, peers: Mapping[int, str], timeout: float = 30.0) -> list[int]:
        """Take the place of this rank in a running job: connect to every peer in ``peers``
        that answers within ``timeout`` seconds (each must have lost this rank and admit
        rejoins, :attr:`admit_rejoins`); returns the ranks reached, the others are lost here.

        Used by :func:`asynccoll.connect` in a restarted process (``ASYNCCOLL_RESTART``).
        Raises :class:`~asynccoll.TransportError` for a transport that cannot rejoin,
        :class:`PeerLostError` when no peer is reached.
        """
        return await self._rejoin(self._checked_peers(peers, timeout), timeout)

    async def _rejoin(self, peers: Mapping[int, str], timeout: float) -> list[int]:
        """The backend's rejoin (:meth:`rejoin`): tcp's and ucx's."""
        raise TransportError(f"transport {self.scheme!r} cannot rejoin a running job; restart "
                             "ranks over tcp or ucx (ASYNCCOLL_TRANSPORT)")

    async def _dial_every(self, peers: Mapping[int, str], timeout: float,
                          dial: Callable[[int, str, float], Awaitable[bool]]) -> list[int]:
        """The backends' rejoin: ``dial(rank, address, deadline)`` every peer at once (True:
        connected), the ranks reached in order; :class:`PeerLostError` when none was."""
        deadline = asyncio.get_running_loop().time() + timeout
        ranks = [r for r in peers if r != self.rank]
        got = await asyncio.gather(*(dial(r, peers[r], deadline) for r in ranks))
        reached = [r for r, ok in zip(ranks, got, strict=True) if ok]
        if ranks and not reached:
            raise lost(min(ranks), f"no rank of the job admitted this one (nobody listens, or "
                                   f"none took it back within {timeout:g} s)")
        return sorted(reached)

    def start_liveness(self, seconds: float) -> None:
        """Probe every peer and drop one silent for ``seconds`` as lost (:mod:`.liveness`).

        Call on the transport's loop once connected; a second call replaces the first.
        Raises ``ValueError`` unless ``seconds`` > 0, :class:`TransportClosedError` after
        :meth:`close`.
        """
        if self._closed:
            raise TransportClosedError("transport closed")
        if self._liveness is not None:
            self._liveness.stop()
        self._liveness = Liveness(self, seconds)

    def drop_peer(self, rank: int, exc: BaseException) -> None:
        """Close the connection of ``rank`` because of ``exc``, as if it broke: its pending
        operations fail, the loss listeners hear of it (with ``exc`` when it is a
        :class:`PeerLostError`). Nothing after :meth:`close`."""
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise ValueError(f"rank must be another rank in 0..{self.world_size - 1}, got {rank}")
        if not self._closed:
            self._drop_peer(rank, exc)

    def _peer_lost(self, rank: int, exc: BaseException) -> int:
        """For the backends: fail every receive from ``rank`` with ``exc`` and tell the
        listeners (of a :class:`PeerLostError`); returns how many receives failed."""
        waiting = self.matcher.fail_peer(rank, exc)
        if not self._closed and isinstance(exc, PeerLostError):
            for cb in list(self._loss_listeners):
                try:
                    cb(rank, exc)
                except Exception:  # a listener's bug must not break the transport
                    log.exception("rank %d: a peer-loss listener failed", self.rank)
        return waiting

    # -- the public interface: checks, then the backend's hook ---------------------------------
    async def listen(self, address: str | None = None) -> str:
        """Start accepting connections at ``address`` (``None``: the backend's default);
        return the concrete address to publish.

        Raises ``RuntimeError`` when called a second time, :class:`TransportClosedError` after
        :meth:`close`, ``ValueError`` for an address of another scheme or form.
        """
        if self._closed:
            raise TransportClosedError("transport closed")
        if self._listening:
            raise RuntimeError(f"rank {self.rank} already listens at {self.address or '...'}; "
                               "listen() may be called once")
        self._listening = True
        try:
            return await self._listen(address)
        except BaseException:
            self._listening = False  # nothing listens: a later listen() may try again
            raise

    async def connect(self, peers: Mapping[int, str], timeout: float = 30.0) -> None:
        """Connect to every peer in ``peers`` (rank -> address) within ``timeout`` seconds.

        This rank's own entry, if any, is ignored. Raises ``ValueError`` for a rank outside
        ``0..P-1`` or a ``timeout`` <= 0, :class:`PeerLostError` naming a rank not reached in
        time, :class:`TransportClosedError` after :meth:`close`.
        """
        await self._connect(self._checked_peers(peers, timeout), timeout)

    def _checked_peers(self, peers: Mapping[int, str], timeout: float) -> dict[int, str]:
        """``peers`` without this rank, once the transport is open, ``timeout`` > 0 and every
        rank is in ``0..P-1`` (:meth:`connect`, :meth:`rejoin`)."""
        if self._closed:
            raise TransportClosedError("transport closed")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        for rank in peers:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"peers: rank {rank} outside 0..{self.world_size - 1}")
        return {r: a for r, a in peers.items() if r != self.rank}

    def post_frame(self, dst: int, kind: int, sched: int, execution: int, tag: int,
                   payload: Any, dtype: str = "", shape: tuple[int, ...] = (),
                   fmt: int = _DENSE) -> asyncio.Future[None]:
        """Send ``payload`` to ``dst`` in a frame whose header this transport builds.

        The header carries the protocol version, ``kind`` (a :class:`~.frames.Kind`), the key
        ``(this rank, sched, execution, tag)``, ``dtype``/``shape``/``fmt`` (a
        :class:`~.frames.Format`) as given, and the payload's length; the caller cannot forge
        the source. ``payload``: a contiguous buffer (a 1-D byte ``memoryview`` is the cheapest)
        or, when :attr:`supports_device`, a CuPy array. This is the engine's send path: it costs
        one header tuple and the backend's send, nothing else. Raises ``ValueError`` for a
        ``dst`` outside ``0..P-1`` or a non-contiguous payload.
        """
        if not 0 <= dst < self.world_size:
            raise ValueError(f"dst must be in 0..{self.world_size - 1}, got {dst}")
        view = self._send_view(payload)
        if self._closed:
            return self._refused()
        h = Header(PROTOCOL_VERSION, kind, sched, execution, tag, self.rank, dtype, shape, fmt,
                   view.nbytes)
        if dst == self.rank:
            return self._loopback(h, view)
        return self._post_send(dst, h, view)

    def post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        """Send a frame with a header the caller made (tests, tools): the first
        ``header.length`` bytes of ``payload`` follow ``header``.

        Prefer :meth:`post_frame`, which builds the header. Raises ``ValueError`` for a ``dst``
        outside ``0..P-1``, a ``header.src`` that is not this rank, or a payload shorter than
        ``header.length``.
        """
        if not 0 <= dst < self.world_size:
            raise ValueError(f"dst must be in 0..{self.world_size - 1}, got {dst}")
        if header.src != self.rank:
            raise ValueError(f"header.src must be this rank {self.rank}, got {header.src}")
        view = self._send_view(payload)
        if view.nbytes != header.length:
            if view.nbytes < header.length:
                raise ValueError(f"payload has {view.nbytes} bytes, header.length is "
                                 f"{header.length}")
            view = view[:header.length]
        if self._closed:
            return self._refused()
        if dst == self.rank:
            return self._loopback(header, view)
        return self._post_send(dst, header, view)

    def post_recv(self, src: int, sched: int, execution: int, tag: int,
                  buf: Any = None) -> asyncio.Future[Message]:
        """Receive the frame keyed ``(src, sched, execution, tag)`` into ``buf`` (or a new one).

        The future resolves to the :class:`~.frames.Message` (its payload a view of ``buf``),
        or fails with :class:`PeerLostError` / :class:`TransportClosedError`, or
        :class:`~asynccoll.errors.ProtocolError` when the message overflows ``buf``. Raises
        ``ValueError`` for a ``src`` outside ``0..P-1`` or a read-only or non-contiguous
        ``buf``.
        """
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in 0..{self.world_size - 1}, got {src}")
        return self._post_recv(src, sched, execution, tag, buf)

    def finish(self, sched: int, execution: int) -> int:
        """Retire the receives of finished executions (see
        :meth:`~.matching.Matcher.finish`)."""
        return self.matcher.finish(sched, execution)

    def forget(self, sched: int) -> None:
        """Drop every receive and held message of schedule ``sched`` (its executor closed)."""
        self.matcher.forget(sched)

    async def close(self) -> None:
        """Close every connection; pending operations fail with :class:`TransportClosedError`.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._liveness is not None:
            self._liveness.stop()
        self.matcher.close(TransportClosedError("transport closed"))
        await self._close()

    # -- the backend's hooks -------------------------------------------------------------------
    @abc.abstractmethod
    async def _listen(self, address: str | None) -> str:
        """Start accepting connections (called once, while open)."""

    @abc.abstractmethod
    async def _connect(self, peers: Mapping[int, str], timeout: float) -> None:
        """Connect to ``peers`` (ranks checked, this rank left out, ``timeout`` > 0)."""

    @abc.abstractmethod
    def _post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        """Send a frame to another rank (``dst`` checked and not this rank, the transport
        open, ``payload`` exactly ``header.length`` bytes as :meth:`_send_view` made it)."""

    def _post_recv(self, src: int, sched: int, execution: int, tag: int,
                   buf: Any) -> asyncio.Future[Message]:
        """Post a receive (``src`` checked); a closed matcher fails it."""
        view = None if buf is None else as_bytes(buf, "receive buffer", writable=True)
        return self.matcher.post(src, sched, execution, tag, view)

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release the backend's resources (called once; the matcher is closed already)."""

    def _drop_peer(self, rank: int, exc: BaseException) -> None:
        """Close the connection of ``rank`` because of ``exc`` (a :class:`ProtocolError`: past
        its memory share; a :class:`PeerLostError`: silent past the liveness time), as a
        broken connection: its operations fail and the loss listeners hear of it. This
        default, for a backend without connections of its own, fails its receives."""
        err = exc if isinstance(exc, PeerLostError) else lost(rank, str(exc), exc)
        self._peer_lost(rank, err)

    def _send_view(self, payload: Any) -> Any:
        """The bytes of a payload as the backend sends them (here a flat host byte view;
        a transport that carries device memory overrides this). ``nbytes`` and slicing are in
        bytes."""
        return as_bytes(payload, "payload")

    def _copy_into(self, slot: Slot, payload: Any) -> None:
        """Copy ``payload`` (exactly the slot's length, from :meth:`_send_view`) into
        ``slot`` (host memory here; a transport that carries device memory overrides this)."""
        slot.view[:] = payload

    # -- internals -----------------------------------------------------------------------------
    def _loopback(self, header: Header, payload: Any) -> asyncio.Future[None]:
        """Deliver a frame to this rank itself (one copy)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            slot = self.matcher.begin(header)
        except ProtocolError as exc:
            fut.set_exception(exc)
            return fut
        if header.length:
            self._copy_into(slot, payload)
        self.matcher.complete(slot)
        fut.set_result(None)
        return fut

    @staticmethod
    def _refused() -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_exception(TransportClosedError("transport closed"))
        return fut


def lost(rank: int, reason: str, cause: BaseException | None = None) -> PeerLostError:
    """A :class:`PeerLostError` for ``rank`` with ``cause`` chained."""
    exc = PeerLostError(rank, reason)
    exc.__cause__ = cause
    return exc
