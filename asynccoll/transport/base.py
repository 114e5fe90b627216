"""The transport interface the schedule engine uses.

A message is a **frame** (:mod:`.frames`: a small msgpack header followed by ``length`` payload
bytes). Frames are matched to receives by ``(source, schedule id, execution, tag)`` in
:class:`Matcher` (:mod:`.matching`), shared by every transport, so that inproc, tcp and ucx
behave the same. A concrete transport only moves bytes: it asks the matcher where a payload goes
(:meth:`Matcher.begin`), writes it there, and says so (:meth:`Matcher.complete`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from ..buffers import as_bytes
from ..errors import PeerLostError, ProtocolError
from .frames import Header, Limits, Message
from .matching import Matcher, Slot

__all__ = ["Transport", "lost"]

log = logging.getLogger("asynccoll.transport")


class Transport(abc.ABC):
    """Point-to-point messaging for one rank.

    Lifecycle: ``await listen()`` (returns the address to publish), ``await connect(peers)``,
    then any number of :meth:`post_send` / :meth:`post_recv`, then ``await close()``.

    Both posting methods return at once with a future, so that the engine needs no task per
    message. A send's future resolves when its payload buffer may be reused (the bytes are
    with the transport or the peer), or fails with :class:`PeerLostError` /
    :class:`TransportClosedError`. A cancelled send may already have sent part of its frame;
    the connection is then closed, since the stream cannot be resynchronised.
    """

    scheme: ClassVar[str]

    def __init__(self, rank: int, world_size: int, *, limits: Limits | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.limits = limits or Limits()
        self.matcher = Matcher(rank, self.limits)

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address peers connect to (valid after :meth:`listen`)."""

    @abc.abstractmethod
    async def listen(self, address: str) -> str:
        """Start accepting connections at ``address``; return the concrete address."""

    @abc.abstractmethod
    async def connect(self, peers: Mapping[int, str], timeout: float = 30.0) -> None:
        """Connect to every peer in ``peers`` (rank -> address) within ``timeout`` seconds."""

    @abc.abstractmethod
    def post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        """Send ``header`` + ``payload`` (a contiguous buffer of ``header.length`` bytes)."""

    def post_recv(self, src: int, sched: int, execution: int, tag: int,
                  buf: Any = None) -> asyncio.Future[Message]:
        """Receive the frame keyed ``(src, sched, execution, tag)`` into ``buf`` (or a new one)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in 0..{self.world_size - 1}, got {src}")
        view = None if buf is None else _writable_bytes(buf)
        return self.matcher.post(src, sched, execution, tag, view)

    def finish(self, sched: int, execution: int) -> int:
        """Retire the receives of finished executions (see :meth:`Matcher.finish`)."""
        return self.matcher.finish(sched, execution)

    @abc.abstractmethod
    async def close(self) -> None:
        """Close every connection; pending operations fail with TransportClosedError."""

    def _loopback(self, header: Header, payload: Any) -> asyncio.Future[None]:
        """Deliver a frame to this rank itself (one copy)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            slot = self.matcher.begin(header)
        except ProtocolError as exc:
            fut.set_exception(exc)
            return fut
        if header.length:
            self._copy_into(slot, payload, header.length)
        self.matcher.complete(slot)
        fut.set_result(None)
        return fut

    def _copy_into(self, slot: Slot, payload: Any, n: int) -> None:
        """Copy the first ``n`` bytes of ``payload`` into ``slot`` (host memory here;
        a transport that carries device memory overrides this)."""
        slot.view[:] = _readable_bytes(payload)[:n]


def _writable_bytes(buf: Any) -> memoryview:
    return as_bytes(buf, "receive buffer", writable=True)


def _readable_bytes(buf: Any) -> memoryview:
    return as_bytes(buf, "send buffer")


def lost(rank: int, reason: str, cause: BaseException | None = None) -> PeerLostError:
    """A :class:`PeerLostError` for ``rank`` with ``cause`` chained."""
    exc = PeerLostError(rank, reason)
    exc.__cause__ = cause
    return exc
