"""Receive matching, shared by every transport so that inproc, tcp and ucx behave the same.

Frames are matched to receives by ``(source, schedule id, execution, tag)``; a receive may be
posted before or after its message arrives. A concrete transport only moves bytes: it asks the
:class:`Matcher` where a payload goes (:meth:`Matcher.begin`), writes it there, and says so
(:meth:`Matcher.complete`). :class:`HeldOrder` keeps early frames of one key in arrival order
for a transport whose payloads may finish out of order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ExecutionError, ProtocolError, TransportClosedError
from .frames import LIVENESS_SCHED, Header, Kind, Limits, Message

__all__ = ["HeldOrder", "Matcher", "Slot", "fail_quietly"]

log = logging.getLogger("asynccoll.transport")

Key = tuple[int, int, int, int]  # (src, sched, execution, tag)


class _Posted:
    __slots__ = ("buf", "fut", "key")

    def __init__(self, key: Key, buf: memoryview | None, fut: asyncio.Future[Message]) -> None:
        self.key = key
        self.buf = buf
        self.fut = fut


class _Account:
    """What one peer makes this rank hold: the bytes charged to it while ``open``."""

    __slots__ = ("bytes", "open", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.bytes = 0
        self.open = True


class Slot:
    """Where one inbound payload goes; returned by :meth:`Matcher.begin`.

    ``charge``: the bytes of memory allocated for it and charged to its sender's share of the
    budget (0 when it lands in a posted receive's own buffer or the shared scratch).
    """

    __slots__ = ("account", "charge", "discard", "header", "posted", "view")

    def __init__(self, header: Header, view: memoryview, posted: _Posted | None,
                 discard: bool = False, account: _Account | None = None,
                 charge: int = 0) -> None:
        self.header = header
        self.view = view
        self.posted = posted
        self.discard = discard  # the payload is read and thrown away
        self.account = account
        self.charge = charge


_SCRATCH = memoryview(bytearray(1 << 16))


class Matcher:
    """Matches inbound frames to posted receives for one rank.

    **One memory budget.** Everything a peer can make this rank allocate counts against
    ``limits.max_held_bytes`` (default 2 GiB), charged to that peer when the memory is
    allocated, that is when the frame's header arrives, before any payload: early messages held
    for a receive not posted yet, whether complete or still streaming in; payloads of receives of
    unknown length (``buf=None``) until delivered; payloads read only to be thrown away (beyond a
    64 KiB shared scratch) until read. A header that claims bytes and never sends them costs its
    claim. Each of the ``P - 1`` peers is granted a share of ``max_held_bytes // (P - 1)``;
    a peer may hold more while the budget has room (one rank broadcasting a large buffer to late
    receivers), and when a claim does not fit, the peers past their shares are dropped: the
    claimant if it is past its own share (:class:`ProtocolError` from :meth:`begin`, the
    transport closes its connection), else the peer holding most, through ``on_drop`` (the
    transport closes that connection with the reason). A dropped peer's held messages are
    released at once; what it was streaming is released by the transport as the connection
    closes (:meth:`abandon`). Buffers come from ``np.empty``, so a claim costs resident memory
    only as its bytes arrive. Costs a dictionary lookup and two additions per allocation.

    Guarantees:

    * frames with the same key are delivered in the order they began arriving;
    * a frame whose receive is posted lands directly in the receive's buffer (no copy);
      an early frame is held (bounded by :class:`Limits`) and copied once when its receive posts;
    * once :meth:`finish` marks execution *e* of a schedule done, its unmatched receives are
      retired (their futures cancelled), later ACTIVATION frames for executions ``<= e`` are
      dropped and later DATA frames for them are recorded in :attr:`errors` and discarded.
    """

    def __init__(self, rank: int, limits: Limits = Limits(), world_size: int = 2) -> None:
        self.rank = rank
        self.limits = limits
        #: the bytes of the budget granted to each peer (see the class doc)
        self.share = limits.max_held_bytes // max(1, world_size - 1)
        self._accounts: dict[int, _Account] = {}
        self._charged = 0  # the sum of the open accounts
        self._dropped: dict[int, ProtocolError] = {}
        self._heard: set[int] = set()
        #: ``on_drop(rank, error)``: close the connection of ``rank``, dropped to make room in
        #: the budget (the transport sets it; the error says why, for its log)
        self.on_drop: Callable[[int, ProtocolError], None] | None = None
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
            self._release(src, len(data))
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
                self._release(h.src, len(data))
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

    @property
    def charged_bytes(self) -> int:
        """The bytes peers make this rank hold now (the budget in use; see the class doc)."""
        return self._charged

    def heard(self) -> set[int]:
        """The ranks a frame came from since the last call (which this resets)."""
        out, self._heard = self._heard, set()
        return out

    def is_lost(self, rank: int) -> bool:
        """Whether ``rank`` was lost or dropped here."""
        return rank in self._lost or rank in self._dropped

    def charged(self, rank: int) -> int:
        """The bytes charged to ``rank`` now."""
        acct = self._accounts.get(rank)
        return acct.bytes if acct is not None else 0

    # -- the transport's side ----------------------------------------------------------------
    def begin(self, header: Header) -> Slot:
        """Choose where the payload of an inbound frame goes.

        Raises :class:`ProtocolError` when holding it would exceed the limits; the transport
        then closes the connection.
        """
        self._heard.add(header.src)  # any frame is a sign of life (liveness)
        dropped = self._dropped.get(header.src)
        if dropped is not None:  # frames it sent before its connection closed
            raise dropped
        if header.sched == LIVENESS_SCHED:
            return self._discard(header)
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
                try:
                    self._bound(header, self.limits.max_held_bytes,
                                "a receive of unknown length")
                    acct = self._charge(header, "a receive of unknown length")
                    return Slot(header, _allocate(header), p, account=acct,
                                charge=header.length)
                except ProtocolError as refused:
                    if not p.fut.done():
                        p.fut.set_exception(refused)
                    raise
            if header.length > len(p.buf):
                exc = ProtocolError(
                    f"message of {header.length} bytes from rank {header.src} overflows the "
                    f"posted receive of {len(p.buf)} bytes (tag {header.tag})")
                if not p.fut.done():
                    p.fut.set_exception(exc)
                return self._discard(header)
            return Slot(header, p.buf[: header.length], p)
        if header.execution < self._finished.get(header.sched, 0) and header.kind != Kind.CONTROL:
            self._late(header)
            return self._discard(header)
        if self._held_count >= self.limits.max_held_messages:
            raise ProtocolError(
                f"too many early messages held ({self._held_count} messages, "
                f"{self._held_bytes} bytes); limit {self.limits.max_held_messages}")
        acct = self._charge(header, "an early message")
        return Slot(header, _allocate(header), None, account=acct, charge=header.length)

    # -- the budget ----------------------------------------------------------------------------
    def _charge(self, header: Header, what: str) -> _Account | None:
        """Charge ``header.length`` bytes to its sender, dropping peers past their shares when
        the budget is short (the class doc); :class:`ProtocolError` drops the sender itself.
        What this rank sends itself is its own doing, not a peer's: never charged."""
        src, n = header.src, header.length
        if src == self.rank:
            return None
        acct = self._accounts.get(src)
        if acct is None:
            acct = self._accounts[src] = _Account(src)
        cap = self.limits.max_held_bytes
        while self._charged + n > cap:
            if acct.bytes + n > self.share:
                err = ProtocolError(
                    f"rank {src} claims {n} bytes for {what} while holding {acct.bytes} here: "
                    f"past its share of {self.share} bytes, and the memory budget of {cap} "
                    f"bytes has {cap - self._charged} left")
                self.drop(src, err)
                raise err
            hog = max(self._accounts.values(), key=lambda a: a.bytes)
            err = ProtocolError(
                f"rank {hog.rank} holds {hog.bytes} bytes here, past its share of {self.share} "
                f"bytes, and rank {src} needs {n} of the full memory budget of {cap} bytes")
            self.drop(hog.rank, err)
            if self.on_drop is not None:
                self.on_drop(hog.rank, err)
        acct.bytes += n
        self._charged += n
        return acct

    def _release(self, src: int, n: int) -> None:
        acct = self._accounts.get(src)
        if acct is not None and n:
            acct.bytes -= n
            self._charged -= n

    def abandon(self, slot: Slot) -> None:
        """``slot``'s payload will never complete (its connection closed): release its memory
        from the budget. Idempotent."""
        acct = slot.account
        if acct is not None and acct.open and slot.charge:
            acct.bytes -= slot.charge
            self._charged -= slot.charge
        slot.charge = 0

    def drop(self, rank: int, err: ProtocolError) -> None:
        """Release everything ``rank`` made this rank hold, at once, and refuse its later
        frames with ``err`` (its connection is closing; the transport fails its receives)."""
        self._release_peer(rank)
        self._dropped[rank] = err

    def _bound(self, header: Header, limit: int, what: str) -> None:
        """Refuse (ProtocolError: the transport drops the peer) a payload over ``limit``
        before anything is allocated for it."""
        if header.length > limit:
            raise ProtocolError(f"rank {header.src} claims a payload of {header.length} bytes "
                                f"for {what}; the limit is {limit}")

    def _discard(self, header: Header) -> Slot:
        self._bound(header, self.limits.max_discard_bytes, "a message to throw away")
        if header.length <= len(_SCRATCH):
            return Slot(header, _SCRATCH[:header.length], None, discard=True)
        acct = self._charge(header, "a message to throw away")
        return Slot(header, _allocate(header), None, discard=True, account=acct,
                    charge=header.length)

    def complete(self, slot: Slot) -> None:
        """The payload of ``slot`` has been written in full."""
        h = slot.header
        if slot.posted is not None:
            self.abandon(slot)  # delivered: the receiver's now, not the sender's charge
            if not slot.posted.fut.done():
                slot.posted.fut.set_result(Message(h, slot.view))
            return
        if slot.discard or (slot.account is not None and not slot.account.open):
            self.abandon(slot)  # thrown away, or its sender was dropped meanwhile
            return
        if h.execution < self._finished.get(h.sched, 0) and h.kind != Kind.CONTROL:
            self.abandon(slot)
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
            self.abandon(slot)
            return
        held = self._held.get(key)
        if held is None:
            self._held[key] = deque(((h, slot.view),))
            self._index(key)
        else:
            held.append((h, slot.view))
        self._held_bytes += h.length
        self._held_count += 1

    def fail_peer(self, rank: int, exc: BaseException) -> int:
        """Fail every receive posted for ``rank`` and every later one with ``exc``.

        Returns how many receives were waiting (and so failed).
        """
        self._lost[rank] = exc
        failed = 0
        for key in [k for k in self._posted if k[0] == rank]:
            for p in self._posted.pop(key):
                failed += not p.fut.done()
                fail_quietly(p.fut, exc)
            self._unindex(key)
        return failed

    def readmit(self, rank: int) -> None:
        """A new process took lost ``rank``'s place (:meth:`.base.Transport.on_peer_joined`):
        forget the old one, its loss, its account and the frames of it held here, so that the
        new one's frames, numbered afresh, never meet the old one's."""
        self._lost.pop(rank, None)
        self._dropped.pop(rank, None)
        self._release_peer(rank)
        self._heard.discard(rank)

    def _release_peer(self, rank: int) -> None:
        """Close ``rank``'s account and throw away the frames of it held here."""
        acct = self._accounts.pop(rank, None)
        if acct is not None:
            acct.open = False
            self._charged -= acct.bytes
            acct.bytes = 0
        for key in [k for k in self._held if k[0] == rank]:
            for _, data in self._held.pop(key):
                self._held_bytes -= len(data)
                self._held_count -= 1
            self._unindex(key)

    def close(self, exc: BaseException | None = None) -> None:
        """Fail every posted receive; later posts fail at once."""
        self._closed = exc or TransportClosedError("transport closed")
        for q in self._posted.values():
            for p in q:
                fail_quietly(p.fut, self._closed)
        self._posted.clear()
        self._held.clear()
        self._keys.clear()
        self._held_bytes = self._held_count = 0
        for acct in self._accounts.values():
            acct.open = False
        self._accounts.clear()
        self._charged = 0

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


def fail_quietly(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut``; its owner's callback still sees the error, but an owner that has gone
    (its loop stopped before the callback ran) does not make asyncio log a warning."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def ignore_outcome(fut: asyncio.Future[Any]) -> None:
    """A done-callback for a send whose failure nobody awaits (a self-activation, a notice to
    a peer that may be gone): retrieve the outcome so asyncio does not log it as lost."""
    if not fut.cancelled():
        fut.exception()


def _allocate(header: Header) -> memoryview:
    """A new buffer for a payload; a ProtocolError (the peer is dropped) if memory is short.

    ``np.empty``, not ``bytearray``: its pages become resident only as the payload fills them,
    so a claim that is never sent costs address space, not memory."""
    try:
        return np.empty(header.length, np.uint8).data
    except MemoryError:
        raise ProtocolError(f"cannot allocate {header.length} bytes for a payload from rank "
                            f"{header.src}") from None


class HeldOrder:
    """Hands finished frames to ``complete`` so that held frames of one key queue in arrival
    order, although their payloads may finish out of order (a small inline frame overtakes a
    large one still streaming). Frames bound to a posted receive need no order and pass at once.
    """

    def __init__(self, complete: Callable[[Slot], None]) -> None:
        self._complete = complete
        self._queues: dict[Key, deque[list[Any]]] = {}

    def reserve(self, slot: Slot) -> list[Any] | None:
        """Take ``slot``'s place in its key's queue before its payload streams in."""
        if slot.posted is not None or slot.discard:
            return None
        entry: list[Any] = [slot, False]
        self._queues.setdefault(_key(slot.header), deque()).append(entry)
        return entry

    def done(self, slot: Slot, entry: list[Any] | None, lost: bool = False) -> None:
        """``slot``'s payload is complete (or ``lost``: drop it without blocking the queue)."""
        key = _key(slot.header)
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


def _key(h: Header) -> Key:
    return (h.src, h.sched, h.execution, h.tag)
