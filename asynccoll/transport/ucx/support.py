"""The machinery under ``ucx://``: the lazy ``ucxx`` import, the event-loop progress engine,
device-memory views, and the authenticating handshake over a UCX endpoint's stream channel.

Nothing here imports ``ucxx`` at module import time.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...buffers import is_cupy
from ...errors import AuthenticationError
from .. import auth
from ..matching import Slot

__all__ = ["DeviceView", "HeldOrder", "Link", "Progress", "handshake_acceptor",
           "handshake_connector", "host_id", "ignore", "load", "stream_io", "tag_base", "target"]

WATCHDOG_S = 0.5
# after the proofs: the tag base the peer sends to us with, the length of the sender's UCX
# worker address (0: no shared-memory endpoint offered) and the sender's host identity
_TAIL = struct.Struct("<QH16s")

_ucx: Any = None  # the lazily imported ucxx modules, see load()

Callback = Callable[[BaseException | None], None]


def load() -> Any:
    """Import ``ucxx`` on first use; ``ImportError`` naming the ``ucx`` extra when absent.

    Returns a namespace with ``lib`` (ucxx's low-level API), ``Array`` and ``Tag``.
    """
    global _ucx
    if _ucx is None:
        # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows: without this every
        # context creation prints two warnings about it. A user's own setting wins.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx  # noqa: F401  (loads libucx and sets ucxx's UCX defaults)
            import ucxx._lib.libucxx as lib
            from ucxx._lib.arr import Array
            from ucxx.types import Tag
        except ImportError as exc:
            raise ImportError(
                f"the ucx:// transport needs the ucxx package ({exc}); install it with: "
                "pip install 'asynccoll[ucx]'") from exc

        class _Mods:
            pass

        mods = _Mods()
        mods.lib, mods.Array, mods.Tag = lib, Array, Tag  # type: ignore[attr-defined]
        _ucx = mods
    return _ucx


class DeviceView:
    """A byte view of a CuPy array that the matcher can slice and fill like a memoryview.

    Held (early) frames are kept in host memory; filling a device view from them copies host to
    device once.
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __len__(self) -> int:
        return int(self.array.nbytes)

    def __getitem__(self, index: slice) -> DeviceView:
        return DeviceView(self.array[index])

    def __setitem__(self, index: slice, data: Any) -> None:
        if is_cupy(data):
            self.array[index] = data
        else:
            self.array[index].set(np.frombuffer(data, np.uint8))

    @property
    def __cuda_array_interface__(self) -> Any:
        return self.array.__cuda_array_interface__


def target(view: Any) -> Any:
    """The object UCX reads or writes for a slot view (the CuPy array behind a device view)."""
    return view.array if isinstance(view, DeviceView) else view


class Progress:
    """Drives one UCX worker from an asyncio loop, without threads and without polling.

    The worker's wake-up descriptor is registered with the loop; on an event, and soon after
    new operations are posted (:meth:`kick`), the worker is progressed until it can be re-armed
    (yielding to the loop every few rounds while UCX stays busy, so that other workers on the
    loop can drain what this one waits for) and finished requests are reaped.
    ``watch(req, cb)`` calls ``cb(None)`` once ``req`` completes, or ``cb(exc)`` with the UCX
    error. Costs O(pending requests) per wake-up; an
    idle worker costs a watchdog wake-up every :data:`WATCHDOG_S` seconds (ucxx documents that a
    wake-up can be missed).
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        worker.init_blocking_progress_mode()
        self.fd: int = worker.epoll_file_descriptor
        self.pending: list[tuple[Any, Callback]] = []
        self.scheduled = False
        self.stopped = False
        loop.add_reader(self.fd, self.run)
        self.watchdog = loop.call_later(WATCHDOG_S, self._tick)

    def watch(self, req: Any, cb: Callback) -> None:
        self.pending.append((req, cb))
        self.kick()

    def kick(self) -> None:
        """Progress soon (after the current callback): new operations were posted."""
        if not self.scheduled and not self.stopped:
            self.scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self.scheduled = False
        if self.stopped:
            return
        w = self.worker
        for _ in range(4):
            w.progress()
            if self.pending:
                self._reap()
            # Re-arm only when UCX has nothing left to do; otherwise its wake-up could be lost.
            if self.stopped or w.arm():
                return
        # UCX is still busy (waiting for room in a shared-memory queue, say, that another
        # worker of this loop must drain): let the loop's other callbacks run, then go on.
        self.kick()

    def _reap(self) -> None:
        keep: list[tuple[Any, Callback]] = []
        done: list[tuple[Any, Callback]] = []
        for item in self.pending:
            (done if item[0].completed else keep).append(item)
        if not done:
            return
        self.pending = keep
        for req, cb in done:
            try:
                req.check_error()
            except Exception as exc:  # the ucxx error hierarchy, mapped by the callback
                cb(exc)
            else:
                cb(None)

    def _tick(self) -> None:
        if not self.stopped:
            self.run()
            self.watchdog = self.loop.call_later(WATCHDOG_S, self._tick)

    def fail_all(self, exc: BaseException) -> None:
        """Give every pending callback ``exc`` and forget the requests."""
        pending, self.pending = self.pending, []
        for _req, cb in pending:
            cb(exc)

    def stop(self, exc: BaseException) -> None:
        """Stop driving the worker; every pending callback gets ``exc``."""
        if self.stopped:
            return
        self.stopped = True
        self.watchdog.cancel()
        self.loop.remove_reader(self.fd)
        self.fail_all(exc)


class HeldOrder:
    """Hands finished frames to ``complete`` so that held frames of one key queue in arrival
    order, although their payloads may finish out of order (a small inline frame overtakes a
    large one still streaming). Frames bound to a posted receive need no order and pass at once.
    """

    def __init__(self, complete: Callable[[Slot], None]) -> None:
        self._complete = complete
        self._queues: dict[tuple[int, int, int, int], deque[list[Any]]] = {}

    def reserve(self, slot: Slot) -> list[Any] | None:
        """Take ``slot``'s place in its key's queue before its payload streams in."""
        if slot.posted is not None or slot.discard:
            return None
        entry: list[Any] = [slot, False]
        self._queues.setdefault(_key(slot), deque()).append(entry)
        return entry

    def done(self, slot: Slot, entry: list[Any] | None, lost: bool = False) -> None:
        """``slot``'s payload is complete (or ``lost``: drop it without blocking the queue)."""
        key = _key(slot)
        q = self._queues.get(key)
        if entry is None:
            if q is None or slot.posted is not None or slot.discard:
                self._complete(slot)
                return
            entry = [slot, True]
            q.append(entry)
        entry[1] = True
        if lost:
            entry[0] = None
        assert q is not None
        while q and q[0][1]:
            ready = q.popleft()[0]
            if ready is not None:
                self._complete(ready)
        if not q:
            del self._queues[key]


def _key(slot: Slot) -> tuple[int, int, int, int]:
    h = slot.header
    return (h.src, h.sched, h.execution, h.tag)


def ignore(_keep: Any, _exc: BaseException | None) -> None:
    """Completion of a control message: nothing to do (``_keep`` holds its buffer till now)."""


@functools.cache
def host_id() -> bytes:
    """16 bytes that differ between hosts (name and boot), equal for ranks on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read()
    except OSError:
        boot = b""
    return hashlib.blake2b(socket.gethostname().encode() + boot, digest_size=16).digest()


def tag_base() -> int:
    """A random even 64-bit tag: frames to us use it for headers and it + 1 for payloads."""
    return int.from_bytes(os.urandom(8), "little") & ~1


async def stream_io(progress: Progress, op: Callable[[Any], Any], buf: bytes | bytearray,
                    deadline: float) -> None:
    """Run one UCX stream operation on ``buf``; wait for it until ``deadline`` (loop time).

    Raises ``TimeoutError`` or the ucxx error.
    """
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    arr = load().Array(buf)
    req = op(arr)

    def done(exc: BaseException | None) -> None:
        del keep[:]  # UCX reads or writes ``buf`` until here
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    keep = [arr, buf]
    progress.watch(req, done)
    await asyncio.wait_for(fut, max(deadline - asyncio.get_running_loop().time(), 0.001))


class Link(NamedTuple):
    """What the handshake settled for one connection."""

    peer: int  #: the authenticated peer rank
    recv_base: int  #: tag base of frames the peer sends to us
    send_base: int  #: tag base of frames we send to the peer
    peer_address: bytes  #: the peer's worker address (b"": no shared-memory offer)
    same_host: bool


async def handshake_connector(progress: Progress, ep: Any, secret: bytes, rank: int, peer: int,
                              world_size: int, offer: bytes, deadline: float) -> Link:
    """The dialling side of :mod:`asynccoll.transport.auth`'s handshake, plus the tag bases and
    the shared-memory offers. Raises :class:`AuthenticationError`, ``TimeoutError`` or the
    ucxx error."""
    nonce_c = auth.new_nonce()
    await stream_io(progress, ep.stream_send,
                    auth.make_hello(rank, world_size, peer, nonce_c), deadline)
    raw = bytearray(auth.CHALLENGE_SIZE)
    await stream_io(progress, ep.stream_recv, raw, deadline)
    ch = auth.parse_challenge(bytes(raw))
    if ch.rank != peer or ch.world_size != world_size:
        raise AuthenticationError(f"expected rank {peer} of {world_size}, reached rank "
                                  f"{ch.rank} of {ch.world_size}")
    auth.verify(auth.acceptor_mac(secret, rank, peer, world_size, nonce_c, ch.nonce), ch.mac,
                f"rank {peer}")
    recv_base = tag_base()
    proof = auth.connector_mac(secret, rank, peer, world_size, nonce_c, ch.nonce)
    await stream_io(progress, ep.stream_send,
                    proof + _TAIL.pack(recv_base, len(offer), host_id()) + offer, deadline)
    ack = bytearray(auth.ACCEPT_SIZE + _TAIL.size)
    await stream_io(progress, ep.stream_recv, ack, deadline)
    if bytes(ack[:auth.ACCEPT_SIZE]) != auth.ACCEPT:
        raise AuthenticationError(f"rank {peer} rejected our proof of the job secret")
    send_base, n, host = _TAIL.unpack_from(ack, auth.ACCEPT_SIZE)
    peer_addr = bytearray(n)
    if n:
        await stream_io(progress, ep.stream_recv, peer_addr, deadline)
    return Link(peer, recv_base, send_base, bytes(peer_addr), host == host_id())


async def handshake_acceptor(progress: Progress, ep: Any, secret: bytes, rank: int,
                             world_size: int, offer: bytes, deadline: float,
                             admit: Callable[[Link], None]) -> Link:
    """The accepting side: authenticate a connector of a lower rank, call ``admit(link)``
    (which raises :class:`AuthenticationError` to refuse, say a duplicate), then accept.
    ``admit`` runs before the acceptance leaves, so no frame can arrive before it. Raises
    :class:`AuthenticationError`, ``TimeoutError`` or the ucxx error."""
    raw = bytearray(auth.HELLO_SIZE)
    await stream_io(progress, ep.stream_recv, raw, deadline)
    hello = auth.parse_hello(bytes(raw))
    who = f"rank {hello.rank}"
    if hello.world_size != world_size or hello.wanted != rank:
        raise AuthenticationError(f"{who} wants rank {hello.wanted} of {hello.world_size}, "
                                  f"this is rank {rank} of {world_size}")
    if not 0 <= hello.rank < rank:
        raise AuthenticationError(f"{who} may not connect to rank {rank} (lower ranks dial)")
    nonce_a = auth.new_nonce()
    mac = auth.acceptor_mac(secret, hello.rank, rank, world_size, hello.nonce, nonce_a)
    await stream_io(progress, ep.stream_send,
                    auth.make_challenge(rank, world_size, nonce_a, mac), deadline)
    proof = bytearray(auth.PROOF_SIZE + _TAIL.size)
    await stream_io(progress, ep.stream_recv, proof, deadline)
    expected = auth.connector_mac(secret, hello.rank, rank, world_size, hello.nonce, nonce_a)
    try:
        auth.verify(expected, memoryview(proof)[:auth.PROOF_SIZE], who)
    except AuthenticationError:
        await stream_io(progress, ep.stream_send, b"\x00" * (auth.ACCEPT_SIZE + _TAIL.size),
                        deadline)
        raise
    send_base, n, host = _TAIL.unpack_from(proof, auth.PROOF_SIZE)
    peer_addr = bytearray(n)
    if n:
        await stream_io(progress, ep.stream_recv, peer_addr, deadline)
    recv_base = tag_base()
    link = Link(hello.rank, recv_base, send_base, bytes(peer_addr), host == host_id())
    admit(link)
    await stream_io(progress, ep.stream_send,
                    auth.ACCEPT + _TAIL.pack(recv_base, len(offer), host_id()) + offer, deadline)
    return link
