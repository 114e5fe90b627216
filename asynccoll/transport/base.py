"""The transport interface the schedule engine uses, the frame header, and receive matching.

A message is a **frame**: a small msgpack header followed by ``length`` payload bytes. Frames are
matched to receives by ``(source, schedule id, execution, tag)``; a receive may be posted before
or after its message arrives. Matching, holding of early messages and the rules for messages of
finished executions live in :class:`Matcher`, shared by every transport, so that inproc, tcp and
ucx behave the same. A concrete transport only moves bytes: it asks the matcher where a payload
goes (:meth:`Matcher.begin`), writes it there, and says so (:meth:`Matcher.complete`).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import msgpack
import numpy as np

from ..buffers import ALLOWED_DTYPES
from ..errors import (
    ExecutionError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Format",
    "Header",
    "Kind",
    "Limits",
    "Matcher",
    "Message",
    "Transport",
    "decode_header",
    "encode_header",
]

log = logging.getLogger("asynccoll.transport")

PROTOCOL_VERSION = 1


class Kind(enum.IntEnum):
    """What a frame carries."""

    DATA = 0  #: payload of a collective; late arrival is an error
    ACTIVATION = 1  #: starts an execution remotely; late arrival is dropped
    CONTROL = 2  #: runtime bookkeeping (handshakes, shutdown); never matched late


class Format(enum.IntEnum):
    """How a payload is laid out."""

    DENSE = 0
    SPARSE = 1
    QUANTIZED = 2
    RAW = 3


class Header(NamedTuple):
    """The fields of a frame header, in wire order."""

    version: int
    kind: int
    sched: int
    execution: int
    tag: int
    src: int
    dtype: str
    shape: tuple[int, ...]
    fmt: int
    length: int


class Message(NamedTuple):
    """A received frame: its header and the payload (a view of the destination buffer)."""

    header: Header
    payload: memoryview


@dataclass(frozen=True)
class Limits:
    """Bounds a transport enforces on what peers send it."""

    max_header_bytes: int = 1024
    max_payload_bytes: int = 1 << 36
    max_ndim: int = 8
    max_held_messages: int = 65536
    max_held_bytes: int = 1 << 31


def encode_header(h: Header) -> bytes:
    """The msgpack bytes of a header (an array, in field order)."""
    out: bytes = msgpack.packb(tuple(h), use_bin_type=True)
    return out


_KINDS = frozenset(int(k) for k in Kind)
_FORMATS = frozenset(int(f) for f in Format)


def decode_header(raw: bytes | memoryview, world_size: int, limits: Limits = Limits()) -> Header:
    """Parse and validate a header; raise :class:`ProtocolError` with the reason otherwise.

    Checks: size bound, msgpack well-formed, 10 fields of the right types, known version, kind
    and format, ranks in ``0..world_size-1``, non-negative ids, dtype on the allow list, shape
    bounded and consistent with ``length`` for dense payloads, ``length`` bounded.
    """
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}")
    try:
        f = msgpack.unpackb(raw, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
    if not isinstance(f, tuple) or len(f) != len(Header._fields):
        raise ProtocolError(f"header must be an array of {len(Header._fields)} fields")
    version, kind, sched, execution, tag, src, dtype, shape, fmt, length = f
    for name, v in (("version", version), ("kind", kind), ("sched", sched),
                    ("execution", execution), ("tag", tag), ("src", src), ("fmt", fmt),
                    ("length", length)):
        if type(v) is not int:
            raise ProtocolError(f"header field {name} must be an int, got {type(v).__name__}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (speaks {PROTOCOL_VERSION})")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if fmt not in _FORMATS:
        raise ProtocolError(f"unknown payload format {fmt}")
    if not 0 <= src < world_size:
        raise ProtocolError(f"source rank {src} outside 0..{world_size - 1}")
    if min(sched, execution, tag) < 0 or max(sched, execution, tag) >= 1 << 63:
        raise ProtocolError("schedule id, execution and tag must be non-negative 64-bit ints")
    if not 0 <= length <= limits.max_payload_bytes:
        raise ProtocolError(f"payload length {length} outside 0..{limits.max_payload_bytes}")
    if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype!r} is not on the allow list")
    if not isinstance(shape, tuple) or len(shape) > limits.max_ndim:
        raise ProtocolError(f"shape must be an array of at most {limits.max_ndim} ints")
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"shape {shape!r} must hold non-negative ints")
        n *= d
    if fmt == Format.DENSE and dtype:
        expect = n * np.dtype(dtype).itemsize
        if expect != length:
            raise ProtocolError(
                f"shape {shape} of {dtype} needs {expect} bytes, header says {length}")
    return Header(version, kind, sched, execution, tag, src, dtype, shape, fmt, length)


Key = tuple[int, int, int, int]  # (src, sched, execution, tag)


class _Posted:
    __slots__ = ("buf", "fut", "key")

    def __init__(self, key: Key, buf: memoryview | None, fut: asyncio.Future[Message]) -> None:
        self.key = key
        self.buf = buf
        self.fut = fut


class Slot:
    """Where one inbound payload goes; returned by :meth:`Matcher.begin`."""

    __slots__ = ("discard", "header", "posted", "view")

    def __init__(self, header: Header, view: memoryview, posted: _Posted | None,
                 discard: bool = False) -> None:
        self.header = header
        self.view = view
        self.posted = posted
        self.discard = discard  # the payload is read and thrown away


_SCRATCH = memoryview(bytearray(1 << 16))


class Matcher:
    """Matches inbound frames to posted receives for one rank.

    Guarantees:

    * frames with the same key are delivered in the order they began arriving;
    * a frame whose receive is posted lands directly in the receive's buffer (no copy);
      an early frame is held (bounded by :class:`Limits`) and copied once when its receive posts;
    * once :meth:`finish` marks execution *e* of a schedule done, its unmatched receives are
      retired (their futures cancelled), later ACTIVATION frames for executions ``<= e`` are
      dropped and later DATA frames for them are recorded in :attr:`errors` and discarded.
    """

    def __init__(self, rank: int, limits: Limits = Limits()) -> None:
        self.rank = rank
        self.limits = limits
        self._posted: dict[Key, deque[_Posted]] = {}
        self._held: dict[Key, deque[tuple[Header, memoryview]]] = {}
        # sched -> keys present in _posted or _held, so that finish() costs O(that schedule's
        # keys), not O(every schedule's), when many persistent schedules share one transport
        self._keys: dict[int, set[Key]] = {}
        self._held_bytes = 0
        self._held_count = 0
        self._finished: dict[int, int] = {}  # sched -> first execution not finished
        self._lost: dict[int, BaseException] = {}
        self._closed: BaseException | None = None
        self.dropped = 0
        self.errors: deque[ExecutionError] = deque(maxlen=64)

    # -- the engine's side -------------------------------------------------------------------
    def post(self, src: int, sched: int, execution: int, tag: int,
             buf: memoryview | None = None) -> asyncio.Future[Message]:
        """Post a receive; the future resolves to the :class:`Message` (payload = view of buf).

        ``buf=None`` receives a payload of any length into a fresh buffer.
        """
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            fut.set_exception(self._closed)
            return fut
        key = (src, sched, execution, tag)
        held = self._held.get(key)
        if held:  # checked before the lost-peer rule: a peer that sent, then closed, delivered
            header, data = held.popleft()
            if not held:
                del self._held[key]
                self._unindex(key)
            self._held_bytes -= len(data)
            self._held_count -= 1
            self._fill(fut, header, buf, data)
            return fut
        if src in self._lost:
            fut.set_exception(self._lost[src])
            return fut
        p = _Posted(key, buf, fut)
        q = self._posted.get(key)
        if q is None:
            self._posted[key] = deque((p,))
            self._index(key)
        else:
            q.append(p)
        return fut

    def finish(self, sched: int, execution: int) -> int:
        """Mark executions ``<= execution`` of ``sched`` finished; retire their receives.

        Returns the number of receives retired.
        """
        self._finished[sched] = max(self._finished.get(sched, 0), execution + 1)
        retired = 0
        keys = self._keys.get(sched)
        if not keys:
            return 0
        for key in [k for k in keys if k[2] <= execution]:
            keys.discard(key)
            for p in self._posted.pop(key, ()):
                if not p.fut.done():
                    p.fut.cancel()
                retired += 1
            for h, data in self._held.pop(key, ()):
                self._held_bytes -= len(data)
                self._held_count -= 1
                self._late(h)
        if not keys:
            del self._keys[sched]
        return retired

    def forget(self, sched: int) -> None:
        """Drop all state of a schedule (on close of its executor)."""
        self.finish(sched, (1 << 63) - 2)
        self._finished.pop(sched, None)

    @property
    def posted_count(self) -> int:
        """Receives posted and still waiting for their message (O(posted) to compute)."""
        return sum(1 for q in self._posted.values() for p in q if not p.fut.done())

    @property
    def held_count(self) -> int:
        """Early messages held until their receive is posted."""
        return self._held_count

    # -- the transport's side ----------------------------------------------------------------
    def begin(self, header: Header) -> Slot:
        """Choose where the payload of an inbound frame goes.

        Raises :class:`ProtocolError` when holding it would exceed the limits; the transport
        then closes the connection.
        """
        key = (header.src, header.sched, header.execution, header.tag)
        q = self._posted.get(key)
        if q and q[0].fut.done():
            q = self._drop_cancelled(key, q)
        if q:
            p = q.popleft()
            if not q:
                del self._posted[key]
                self._unindex(key)
            if p.buf is None:
                return Slot(header, memoryview(bytearray(header.length)), p)
            if header.length > len(p.buf):
                exc = ProtocolError(
                    f"message of {header.length} bytes from rank {header.src} overflows the "
                    f"posted receive of {len(p.buf)} bytes (tag {header.tag})")
                if not p.fut.done():
                    p.fut.set_exception(exc)
                return Slot(header, _scratch(header.length), None, discard=True)
            return Slot(header, p.buf[: header.length], p)
        if header.execution < self._finished.get(header.sched, 0) and header.kind != Kind.CONTROL:
            self._late(header)
            return Slot(header, _scratch(header.length), None, discard=True)
        if (self._held_count >= self.limits.max_held_messages
                or self._held_bytes + header.length > self.limits.max_held_bytes):
            raise ProtocolError(
                f"too many early messages held ({self._held_count} messages, "
                f"{self._held_bytes} bytes); limit {self.limits.max_held_messages} / "
                f"{self.limits.max_held_bytes}")
        return Slot(header, memoryview(bytearray(header.length)), None)

    def complete(self, slot: Slot) -> None:
        """The payload of ``slot`` has been written in full."""
        h = slot.header
        if slot.posted is not None:
            if not slot.posted.fut.done():
                slot.posted.fut.set_result(Message(h, slot.view))
            return
        if slot.discard:
            return
        if h.execution < self._finished.get(h.sched, 0) and h.kind != Kind.CONTROL:
            self._late(h)  # its execution finished while the payload streamed in
            return
        key = (h.src, h.sched, h.execution, h.tag)
        q = self._posted.get(key)
        if q and q[0].fut.done():
            q = self._drop_cancelled(key, q)
        if q:  # a receive was posted while the payload streamed in
            p = q.popleft()
            if not q:
                del self._posted[key]
                self._unindex(key)
            self._fill(p.fut, h, p.buf, slot.view)
            return
        held = self._held.get(key)
        if held is None:
            self._held[key] = deque(((h, slot.view),))
            self._index(key)
        else:
            held.append((h, slot.view))
        self._held_bytes += h.length
        self._held_count += 1

    def fail_peer(self, rank: int, exc: BaseException) -> None:
        """Fail every receive posted for ``rank`` and every later one with ``exc``."""
        self._lost[rank] = exc
        for key in [k for k in self._posted if k[0] == rank]:
            for p in self._posted.pop(key):
                _fail_quietly(p.fut, exc)
            self._unindex(key)

    def close(self, exc: BaseException | None = None) -> None:
        """Fail every posted receive; later posts fail at once."""
        self._closed = exc or TransportClosedError("transport closed")
        for q in self._posted.values():
            for p in q:
                _fail_quietly(p.fut, self._closed)
        self._posted.clear()
        self._held.clear()
        self._keys.clear()
        self._held_bytes = self._held_count = 0

    # -- internals ---------------------------------------------------------------------------
    def _index(self, key: Key) -> None:
        keys = self._keys.get(key[1])
        if keys is None:
            self._keys[key[1]] = {key}
        else:
            keys.add(key)

    def _drop_cancelled(self, key: Key, q: deque[_Posted]) -> deque[_Posted] | None:
        """Drop receives their owner cancelled from the head of ``q``: not destinations now."""
        while q and q[0].fut.done():
            q.popleft()
        if q:
            return q
        del self._posted[key]
        self._unindex(key)
        return None

    def _unindex(self, key: Key) -> None:
        if key in self._posted or key in self._held:
            return
        keys = self._keys.get(key[1])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys[key[1]]

    def _late(self, h: Header) -> None:
        if h.kind == Kind.ACTIVATION:
            self.dropped += 1
            return
        err = ExecutionError(
            f"rank {self.rank}: data message from rank {h.src} for finished execution "
            f"{h.execution} of schedule {h.sched} (tag {h.tag})")
        log.warning("%s", err)
        self.errors.append(err)

    @staticmethod
    def _fill(fut: asyncio.Future[Message], h: Header, buf: memoryview | None,
              data: memoryview) -> None:
        if buf is None:
            fut.set_result(Message(h, data))
            return
        if len(data) > len(buf):
            fut.set_exception(ProtocolError(
                f"message of {len(data)} bytes from rank {h.src} overflows the posted receive "
                f"of {len(buf)} bytes (tag {h.tag})"))
            return
        view = buf[: len(data)]
        view[:] = data
        fut.set_result(Message(h, view))


def _fail_quietly(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut``; its owner's callback still sees the error, but an owner that has gone
    (its loop stopped before the callback ran) does not make asyncio log a warning."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def _scratch(n: int) -> memoryview:
    """A throw-away destination for a payload that will be discarded."""
    if n <= len(_SCRATCH):
        return _SCRATCH[:n]
    return memoryview(bytearray(n))


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
            slot.view[:] = _readable_bytes(payload)[: header.length]
        self.matcher.complete(slot)
        fut.set_result(None)
        return fut


def _writable_bytes(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("receive buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8).data
    m = memoryview(buf)
    if m.readonly:
        raise ValueError("receive buffer must be writable")
    return m.cast("B") if m.format != "B" or m.ndim != 1 else m


def _readable_bytes(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("send buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8).data
    m = memoryview(buf)
    return m.cast("B") if m.format != "B" or m.ndim != 1 else m


def lost(rank: int, reason: str, cause: BaseException | None = None) -> PeerLostError:
    """A :class:`PeerLostError` for ``rank`` with ``cause`` chained."""
    exc = PeerLostError(rank, reason)
    exc.__cause__ = cause
    return exc
