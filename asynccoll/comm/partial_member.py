"""The membership side of a partial allreduce handle (DESIGN §6): how it is planned, armed,
settled and rebuilt when the membership changes, and released.

* **Plan and arm**: a handle whose route (:mod:`.route`) says shared memory makes its segments
  at creation and is armed only once every rank has said whether its own exist
  (:func:`~.route.agree_flags`): unless all do, every rank rebuilds for the network, with one
  warning naming why.
* **The data phase through shared memory**: the segments' life (:class:`.shm.PartialSegments`):
  mapped at the first execution, unlinked once every peer has them, a lost peer's unlinked by
  name, all of them at close.
* **Settle and rebuild** (a lost rank, :mod:`.survival`): the handle's public membership side,
  ``completed``, ``failure``, ``survivable``, ``result_buffers``, ``complete_settled``,
  ``put_back``, ``rebuild``, is all the survival state uses.

:class:`MemberSide` is a part of :class:`~.partial.PartialAllreduce`, in a module of its own for
size; the handle's state is declared here for the type checker and set by the handle.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from ..collectives.partial import (
    ARRIVAL_KINDS,
    ARRIVED,
    COUNT,
    DSIG,
    FLUSHING,
    FRESH,
    PLANNED,
    SHM_ATTACH,
    SNAPSHOTS,
    DeadlineConfig,
    deadline_signature,
    initiators,
)
from ..collectives.policy import Accumulate
from ..errors import (
    CollectiveTimeoutError,
    PeerLostError,
)
from ..results import PartialResult
from ..sched import Executor, Kernel, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
from .contribution import Contribution
from .route import agree_flags
from .shm import PartialSegments
from .stall import wait_or_warn

__all__ = ["HandleState", "MemberSide", "Survives", "locked_snapshots", "stable_id"]

log = logging.getLogger("asynccoll.comm")


class Survives(Protocol):
    """What a handle needs of its survival state (:class:`.survival.Survival`; typed here
    so that this module does not import it, nor the Communicator it holds)."""

    lost: frozenset[int]
    comm: Any

    def after_snapshot(self, e: int, data: Any, count: int) -> None: ...

    def after_complete(self, e: int, work: Any, meta: Any) -> None: ...

    async def recover(self) -> None: ...

    def start(self) -> None: ...

    def cancel(self) -> None: ...

    def moved_to(self, comm: Any) -> None: ...


def stable_id(text: str, space: int) -> int:
    """A 60-bit id of ``text`` in id space ``space`` (0-3): equal on every rank and run."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return ((4 + space) << 60) | (h & ((1 << 60) - 1))


class HandleState:
    """The state of :class:`~.partial.PartialAllreduce` that its parts (:class:`MemberSide`,
    :class:`~.partial_results.KeptResults`) use, declared once for the type checker; the
    handle sets it."""

    name: str
    kind: str
    rank: int
    world_size: int
    quorum: int | None
    seed: int
    timeout: float | None
    stall_warn: float | None
    accumulate: Accumulate
    deadline_config: DeadlineConfig | None
    next_deadline: float | None
    schedule: Schedule
    _ex: Executor
    _lock: threading.RLock
    _closed: bool
    _busy: bool
    _contribution: Contribution
    _like: Any
    _meta: Any
    _state: Any
    _bufs: dict[str, Any]
    _kernels: dict[str, Kernel]
    _transport: Transport
    _live: LiveOps | None
    _writer: TraceWriter | None
    _segments: PartialSegments | None
    _route: asyncio.Future[None] | None
    _survival: Survives | None
    #: the quorum the handle was made with (set at its first rebuild; None before)
    _quorum_asked: int | None = None
    _value: Any
    _vmeta: Any
    _vold: tuple[int, list[int]] | None
    _given: int
    _round: int
    _last_flush: int
    _flushing_seen: int
    _planned_seen: int
    _stamps: slice
    _takes: collections.deque[tuple[PartialResult, Any, Any, int]]
    _wait_round: int
    _wait_included: bool
    _wait_stamp: int
    _first_stamp: int
    _deadline_of: dict[int, float]
    _spreads: collections.deque[float]


class MemberSide(HandleState):
    """The membership side of :class:`~.partial.PartialAllreduce` (module doc)."""

    # the handle's own (this class is a part of it)
    def _on_complete(self, e: int) -> None:
        raise NotImplementedError

    def _executor(self, transport: Transport, sched: Schedule, bufs: dict[str, Any],
                  live: LiveOps | None, first: int) -> Executor:
        raise NotImplementedError

    def _arm(self, ex: Executor) -> None:
        raise NotImplementedError

    def _force(self, e: int) -> None:
        raise NotImplementedError

    def _relayout(self) -> None:
        raise NotImplementedError

    async def _await(self, fut: asyncio.Future[int], timeout: float | None, e: int) -> None:
        t = self.timeout if timeout is None else timeout
        try:
            await wait_or_warn(fut, t, self.stall_warn,
                               lambda: f"rank {self.rank}: {self.kind} allreduce {self.name!r} "
                                       f"execution {e}", self._ex.pending_text)
        except PeerLostError as exc:
            self._shm_failed(exc)
            raise
        except asyncio.TimeoutError:
            pend = self._ex.pending()
            if self._writer is not None:
                self._writer.write_pending(self._ex, reason=f"timeout after {t} s")
            who = sorted(initiators(self.kind, e, self.world_size, self.seed))
            # A handle's schedule and data path are chosen at its creation on each rank alone:
            # ranks that chose differently wait for messages that never come. Say so at the
            # first execution, where it shows.
            first = "" if e else f"; {self._first_words(e)}"
            raise CollectiveTimeoutError(
                f"rank {self.rank}: {self.kind} allreduce {self.name!r} execution {e} not "
                f"complete after {t} s (initiators "
                f"{who if self.kind not in ARRIVAL_KINDS else 'any'}"
                f"{'' if self.quorum is None else f', quorum {self.quorum}'}); waiting on: "
                + "; ".join(d for _, _, d in pend) + first, pend) from None

    def _first_words(self, e: int) -> str:
        """What a timeout of execution ``e`` adds when it is the first: a handle's schedule
        and data path are chosen at its creation on each rank alone, so ranks that chose
        differently wait for messages that never come."""
        if e:
            return ""
        path = "through shared memory" if self._segments is not None else "over the network"
        return (f"the first execution of {self.name!r}: every rank must create the handle "
                "alike (kind, like, algorithm, quorum, shm) under the same ASYNCCOLL_SHM (this "
                f"rank's data goes {path})")

    def _start_route(self, refused: OSError | None) -> None:
        """Agree on the route in the background (:meth:`_agree_route`); the first call waits
        for it (:meth:`_routed`). ``refused``: why this rank's segments could not be made."""
        self._route = asyncio.ensure_future(self._agree_route(refused))
        self._route.add_done_callback(_retrieve)

    async def _agree_route(self, refused: OSError | None) -> None:
        """Before the first execution: every rank says whether its segments exist; unless
        all do, every rank's data phase goes over the network, with one warning naming why
        (:mod:`.route`). A rank lost meanwhile fails the executor with it (a surviving handle
        then goes on over the network, as after any loss)."""
        what = f"partial allreduce {self.name!r}"
        try:
            failed = await agree_flags(self._transport, stable_id(f"{self.name}#route", 1),
                                       refused is None, self.timeout, what)
        except BaseException as exc:  # a lost rank, a timeout, the handle closed
            self._take_network()
            self._ex.abort(exc)
            raise
        if not failed:
            self._arm(self._ex)
            return
        why = f"here: {refused}" if refused is not None else "see the log of those ranks"
        log.warning("rank %d: %s: rank(s) %s could not make their shared-memory segments (%s); "
                    "its data goes over the network on every rank", self.rank, what, failed, why)
        self._take_network()
        sched, bufs = self._contribution.build(self._like, self.rank, self.world_size,
                                               self.kind, self.quorum)
        self._meta, self._state, self.schedule, self._bufs = \
            bufs["meta"], bufs["state"], sched, bufs
        self._state[DSIG] = deadline_signature(self.deadline_config)
        if self._live is not None:
            # never armed, so nothing posted to retire (closing it would make the transport
            # drop the peers' early messages, held under the same schedule id)
            self._live.discard(self._ex)
        self._arm(self._executor(self._transport, sched, bufs, self._live, 0))

    def _take_network(self) -> None:
        """Leave shared memory for the network (the segments unlinked and unmapped)."""
        self._shm_close()
        self._contribution.go_network()

    async def _routed(self, timeout: float | None) -> None:
        """Wait for the route's agreement (the first call only), at most ``timeout`` seconds
        (default: the handle's); raise what it failed with."""
        route = self._route
        if route is not None:
            if not route.done():
                t = self.timeout if timeout is None else timeout
                try:
                    await asyncio.wait_for(asyncio.shield(route), t)
                except asyncio.TimeoutError:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: {self.kind} allreduce {self.name!r} execution 0 not "
                        f"complete after {t} s; waiting on: the other ranks to say whether "
                        f"they made their segments; {self._first_words(0)}") from None
            self._route = None
            exc = route.exception()
            if exc is not None and not self.survivable(exc):
                raise exc

    def _attach(self, out: Any, inputs: Any, params: Any, msgs: Any) -> None:
        """The schedule's :data:`~.shm.SHM_ATTACH` kernel: every peer has said "written", so
        its segments exist; map those not mapped yet and bind them (the first execution)."""
        segs = self._segments
        if segs is not None and segs.attach_or_wait(self._ex):
            self._ex.bind({**self._bufs, **segs.buffers(self._ex.execution % 2)})

    def _shm_next(self, e: int) -> None:
        """After execution ``e``: unlink this rank's segments once every peer has mapped them
        (``e >= 1``, :class:`~.shm.PartialSegments`), and bind the other set for ``e + 1``."""
        segs = self._segments
        assert segs is not None
        if e >= 1 and not segs.unlinked:
            segs.unlink_own()
        if segs.parts > 1:  # one set: bound already (by the attach, the first time)
            self._ex.bind({**self._bufs, **segs.buffers((e + 1) % 2)})

    def _shm_failed(self, err: BaseException | None) -> None:
        """The executor failed: nobody maps this rank's segments any more, so unlink them, and
        a lost peer's, which it cannot unlink itself (by name)."""
        segs = self._segments
        if segs is None or err is None:
            return
        if isinstance(err, PeerLostError):
            segs.forget(err.rank)
        segs.unlink_own()

    def _shm_close(self) -> None:
        """Unlink and unmap the segments (at close, or when the data phase leaves them)."""
        segs, self._segments = self._segments, None
        if segs is not None:
            err = self._ex.error
            if isinstance(err, PeerLostError):
                segs.forget(err.rank)
            if self._survival is not None:
                for q in self._survival.lost:
                    segs.forget(q)
            segs.close()
            self._kernels.pop(SHM_ATTACH, None)

    def survivable(self, err: BaseException | None) -> bool:
        """Whether ``err`` (an execution's) is a loss this handle goes on without."""
        return self._survival is not None and isinstance(err, PeerLostError) \
            and not self._closed

    @property
    def failure(self) -> BaseException | None:
        """What the executor failed with (None while it runs)."""
        return self._ex.error

    def follow(self, survival: Survives) -> None:
        """Go on without lost ranks through ``survival`` (:mod:`.survival`, which drives the
        membership side below: :meth:`result_buffers`, :meth:`complete_settled`,
        :meth:`put_back`, :meth:`rebuild`). A loss learned before (the handle made while a
        rank was dying) fails the executor with it now and starts the recovery, as a loss
        learned later would. On the runtime's loop."""
        self._survival = survival
        self._catch_up(survival)

    def _catch_up(self, survival: Survives) -> None:
        """A loss its communicator learned before this handle followed it (made while a rank
        was dying, or grown onto a group with a rank already lost): fail the executor with
        it and start the recovery, as a loss learned later would."""
        lost = survival.comm.membership.lost
        if lost is not None:
            if self._ex.error is None:
                self._ex.abort(PeerLostError(lost.rank, lost.reason))
            survival.start()

    async def _survive(self) -> None:
        assert self._survival is not None
        await self._survival.recover()

    def _snapped(self, inputs: Any, params: Any) -> None:
        """After a snapshot (under the lock): a surviving handle keeps a copy of it."""
        if self._survival is not None:
            state, meta = inputs[3], inputs[2]
            self._survival.after_snapshot(int(state[SNAPSHOTS]) - 1,
                                          self._contribution.snapshot_of(inputs, params),
                                          int(meta[params["rank"]]))

    def result_buffers(self) -> tuple[Any, Any]:
        """Where an execution's result lands: the data buffer and the meta vector."""
        return self._contribution.result_buffers()

    def complete_settled(self, e: int) -> None:
        """Execution ``e``'s result was written into :meth:`result_buffers` by the recovery
        (another survivor completed it): complete it here as if it had arrived."""
        self._on_complete(e)

    def put_back(self, snapshot: Any, count: int) -> None:
        """Put a snapshot of ``count`` contributions no execution completed back into the
        send buffer."""
        with self._lock:
            self._contribution.put_back(snapshot)
            self._state[COUNT] += count

    def rebuild(self, comm: Any, first: int, ranks: list[int]) -> None:
        """Go on over ``comm`` (the survivors' Communicator), from execution ``first``: the
        schedule built for its ranks, the send buffer and its count carried over
        (:mod:`.survival`). ``ranks``: the new rank of each rank of the world so far (-1:
        lost).

        A result kept and not yet handed out (an execution of the world so far, completed
        here or settled by the recovery) stays as it is: the next call or flush hands it out
        with that world's size and counts, as the survivors that received it before the loss
        got it; only if a new world's execution completes first are the two merged
        (accumulating), its counts then moved to the new ranks (the lost ranks' dropped)."""
        c = self._contribution
        transport = comm.transport
        with self._lock:
            old_acc, st = c.send_buffer, self._state
            count, flushing, planned = int(st[COUNT]), int(st[FLUSHING]), int(st[PLANNED])
            self._relayout()  # (kept across an earlier rebuild, still not handed out)
            kept = None if self._value is None else (self.world_size, list(ranks))
            P = self.world_size = transport.world_size
            self.rank = transport.rank
            if self.quorum is not None:
                if self._quorum_asked is None:
                    self._quorum_asked = self.quorum
                # lowered for fewer survivors, raised again (never past what was asked) when
                # lost ranks come back (:meth:`grow`)
                self.quorum = min(self._quorum_asked, P)
            # the survivors' world goes over the network (docs/collectives.md)
            self._shm_close()
            c.go_network()
            sched, bufs = c.build(self._like, self.rank, P, self.kind, self.quorum,
                                  keep=old_acc)
            if bufs["acc"] is not old_acc:
                c.carry(old_acc, bufs["acc"])
            self._meta, self._state = bufs["meta"], bufs["state"]
            st = self._state
            st[COUNT], st[FLUSHING], st[SNAPSHOTS] = count, flushing, first
            st[PLANNED] = planned
            st[DSIG] = deadline_signature(self.deadline_config)
            self.schedule = sched
            self._vold = kept
            if kept is None:
                self._vmeta = np.zeros(len(self._meta), np.int64)
            self._stamps = slice(2 * P + 2, 3 * P + 2)
            self._takes.clear()  # results of cancelled calls in the old world: not given back
            self._flushing_seen = 0
            self._planned_seen = 0  # (a plan still in force shows in the new world's first)
            # the flushes' key, agreed again: a loss can end a flush on some ranks (its final
            # execution completed there) and not on others (which finish it in the new world)
            self._last_flush = first - 1
            self._writer = comm.trace_writer
            if self._wait_round >= first:
                # the waiting call's data (put back, or never taken) goes into the new world's
                # execution
                self._wait_included = True
            self._bufs = bufs
            old = self._ex
            self._arm(self._executor(transport, sched, bufs, comm.live, first))
        old.close()

    @property
    def communicator(self) -> Any:
        """The communicator the handle runs on now: the survivors' after a loss, the grown
        one after a join (None for a handle that does not survive losses)."""
        return None if self._survival is None else self._survival.comm

    def grow(self, comm: Any, first: int, ranks: list[int]) -> None:
        """Go on over ``comm``, a membership that took lost ranks back (:mod:`.joining`),
        from execution ``first``: :meth:`rebuild` for it, and the survival state follows it.
        Call it at a flush boundary (every member has completed the same executions and
        holds no contribution; the joining protocol makes sure), on every member with the
        same ``comm`` and ``first``; a process that joined calls it on its new handle with
        ``ranks`` = its ranks in order. On the runtime's loop."""
        self.rebuild(comm, first, ranks)
        with self._lock:
            # At a flush boundary everything up to ``first - 1`` is completed and handed out
            # (a new handle of a process that joined starts there too)
            self._round = max(self._round, first - 1)
            self._given = max(self._given, first - 1)
        if self._survival is not None:
            self._survival.moved_to(comm)
            self._catch_up(self._survival)  # a joiner lost during its admission

    def _rejoin(self, e: int, stamp: int) -> asyncio.Future[int]:
        """After a recovery that left execution ``e`` to the new world: the waiting call
        takes part in it afresh (its data is in the send buffer again)."""
        with self._lock:
            self._wait_included = True
            self._state[FRESH] = 1
            self._state[ARRIVED] = stamp
        fut = self._ex.current
        if self._flushing_seen:
            self._force(e)
        elif self.rank in initiators(self.kind, e, self.world_size, self.seed):
            self._ex.start()
        return fut


#: the kernels that move a send buffer into an execution (dense and sparse partials)
_SNAPSHOT_KERNELS = ("partial_snapshot", "partial_sparse_snapshot")


def _retrieve(fut: asyncio.Future[None]) -> None:
    """Mark the route agreement's outcome retrieved (the first call raises it, if it failed)."""
    if not fut.cancelled():
        fut.exception()


def locked_snapshots(kernels: Mapping[str, Kernel], lock: threading.RLock,
                      after: Callable[[Any, Any], None]) -> dict[str, Kernel]:
    """``kernels`` with each snapshot kernel run under ``lock`` (the handle's; module doc),
    followed there by ``after(inputs, params)``."""
    out = dict(kernels)
    for name in _SNAPSHOT_KERNELS:
        fn = out.get(name)
        if fn is not None:
            out[name] = _under(lock, fn, after)
    return out


def _under(lock: threading.RLock, fn: Kernel,
           after: Callable[[Any, Any], None] | None) -> Kernel:
    def kernel(out: Any, inputs: Any, params: Any, msgs: Any) -> Any:
        with lock:
            got = fn(out, inputs, params, msgs)
            if after is not None:
                after(inputs, params)
            return got
    return kernel

