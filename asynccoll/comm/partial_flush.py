"""The flush of a partial allreduce (:class:`~.partial.PartialAllreduce`'s part that drains
it: docs/partial.md, "flush"), planned or not, and the checks every call and flush makes first.

A flush is collective: every rank calls it after its last call, each flushing rank forces one
execution, and the flush ends at the first execution in which every rank was flushing. A
*planned* flush (:meth:`FlushSide.plan_flush`) is held in one execution: every flush tells the
other ranks it began (an empty frame keyed by the round of the last flush, which every rank
agrees on and every rebuild sets again), and a planned one forces its execution only once every
rank said so, an execution completed, or a patience of a few of this rank's steps passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..collectives.partial import COUNT, FLUSHING, PLANNED, SNAPSHOTS
from ..errors import BusyError, PeerLostError, TransportClosedError
from ..results import PartialResult
from .contribution import Combine
from .partial_member import MemberSide
from .partial_results import KeptResults
from .progress import ProgressEngine
from .route import exchange

__all__ = ["PLAN_PATIENCE", "FlushSide"]

log = logging.getLogger("asynccoll.comm")

#: how long a planned flush waits for every rank to say it began before it forces an
#: execution as any flush does (seconds; a safety net: the ranks come within a step's time)
PLAN_PATIENCE = 10.0


class FlushSide(KeptResults, MemberSide):
    """The flush and the checks before a call (module doc); the handle provides the rest."""

    _engine: ProgressEngine  # the communicator's (runs coroutines on the runtime's loop)
    _owner: asyncio.Task[Any] | None  # the call or flush that holds the handle
    _plan_sid: int  # the channel of the flushes' "began" messages
    _last_call: float
    _gap: float  # the time between this rank's calls, a moving average (:meth:`_note_gap`)

    async def flush(self, timeout: float | None = None, x: Any = None, *,
                    combine: Combine | None = None, out: Any = None) -> PartialResult:
        """Collective and synchronous: drain every contribution; return what was not given.

        Every rank must call it, after its last call of the handle (calls may resume after it).
        A flushing rank marks its snapshots "flushing" and forces one execution (bypassing the
        initiator set and the quorum); while any rank is flushing, the others' calls activate
        executions themselves, so no call waits for an initiator that has stopped calling.
        Flush returns at the first execution in which all P ranks were flushing: the same one
        on every rank. Afterwards no contribution is left in any send buffer and no execution
        is under way. Returns the latest result (accumulating: the sum of all results
        not yet given) with ``included=True``, ``flushed=True`` and ``missed`` = the number of
        further results folded in (or superseded). Costs one to a few executions; it waits
        (without polling) for the slowest rank to reach its flush.

        ``x`` (optional): a last contribution, added first as a call adds it (``combine`` as
        for a call; ``out`` as a call's): ``h.flush(x=g)`` is ``h(g)`` followed by
        ``h.flush()`` in one execution where every rank does the same, which is what
        :meth:`plan_flush` arranges. Its arrival is not a call's (``fresh`` does not name
        this rank: no call waited for an execution).
        """
        dest = None if out is None else (out, self._contribution.check_out(out))
        flat = None if x is None else self._contribution.check(x)
        res = await self._engine.run(self._flush(timeout, flat, combine, dest,
                                                 planned=self.flush_planned))
        if dest is not None:
            self._recycle(res)
        return res

    def plan_flush(self) -> None:
        """Ask every rank to flush at its next call (local, any thread, idempotent).

        This rank's snapshots say so from now on, until its flush begins; every rank learns
        it when an execution carrying it completes (:attr:`flush_planned`). A training loop
        that checks :attr:`flush_planned` before each step and then calls ``flush(x=g)``
        instead of ``h(g)`` holds a flush in one execution: a planned flush forces its
        execution only once every rank said it began its flush (or once an execution
        completed), where a flush called after a step costs a step's execution and one to
        three more. Eager-SGD's sync events for taking a rank in
        (:mod:`asynccoll.train.joining`)."""
        with self._lock:
            self._state[PLANNED] = 1

    @property
    def flush_planned(self) -> bool:
        """Whether the latest execution completed on this rank carried a planned flush of
        some rank (:meth:`plan_flush`) that no flush has ended since."""
        return bool(self._planned_seen)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"partial allreduce {self.name!r} is closed")
        # A failed persistent executor does not re-arm; its error ends the handle, unless
        # the handle survives a lost rank (the call recovers first).
        err = self._ex.error
        if err is not None and not self.survivable(err):
            self._shm_failed(err)
            raise err

    async def _after_cancelled(self) -> None:
        """A call or flush made while the one before it still unwinds from its cancellation
        (its caller had the ``CancelledError`` of a ``wait_for`` timeout; its side on the
        progress thread has not finished) waits for it instead of raising
        :class:`~asynccoll.BusyError`: callers retry after a timeout."""
        owner = self._owner
        if self._busy and owner is not None and owner is not asyncio.current_task() \
                and _cancelling(owner):
            await asyncio.wait({owner})

    def _add(self, flat: Any, combine: Combine | None, late: bool) -> None:
        st = self._state
        st[COUNT] = self._contribution.add(flat, int(st[COUNT]), combine, late)

    def _note_gap(self) -> None:
        """The time between this rank's calls (a moving average: a planned flush's patience)."""
        now = time.monotonic()
        if self._last_call:
            self._gap = 0.8 * self._gap + 0.2 * (now - self._last_call)
        self._last_call = now

    def _say_arrived(self) -> asyncio.Future[Any] | None:
        """At the start of a flush, every flush (on the loop): tell every rank this one began
        it, and receive theirs; returns a future done once every other rank said so or was
        lost (None in a world of one). Each flush of the handle is one key (the round of the
        last flush: the same on every rank), so every rank's messages meet posted receives:
        nothing is left waiting or held. A planned flush waits on it before forcing."""
        if self.world_size == 1:
            return None
        got = exchange(self._ex.transport, self._plan_sid, self._last_flush + 1, b"")
        # (a lost rank's receive fails: counted as arrived)
        return asyncio.gather(*got.values(), return_exceptions=True)

    async def _flush(self, timeout: float | None, flat: Any = None,
                     combine: Combine | None = None,
                     dest: tuple[Any, Any] | None = None, planned: bool = False
                     ) -> PartialResult:
        self._check_open()
        await self._after_cancelled()
        with self._lock:
            if self._busy:
                raise BusyError(f"partial allreduce {self.name!r} already has a call or flush "
                                "under way")
            self._busy = True
            self._owner = asyncio.current_task()
        try:
            await self._routed(timeout)
        except BaseException:
            self._busy = False
            raise
        if flat is not None:  # the last contribution (in this flush's result)
            self._note_gap()
            with self._lock:
                self._add(flat, combine, False)
        loop = asyncio.get_running_loop()
        t = self.timeout if timeout is None else timeout
        deadline = None if t is None else loop.time() + t
        ex = self._ex
        P = self.world_size
        # From now on every snapshot of this rank says "flushing" (the kernel does not reset
        # it); the flush ends at the first execution in which all P ranks said so. Each rank
        # forces one execution that is not yet activated here after it began flushing, so the
        # execution forced by the last rank to begin is such an execution (every rank's
        # snapshot of it comes after its own start) and nobody waits on a rank that is done.
        with self._lock:
            self._state[FLUSHING] = 1
            self._state[PLANNED] = 0  # (the flush it planned is under way: FLUSHING says so)
        arrived = self._say_arrived()
        forced = False
        try:
            # (a plan learned in a world that lost a rank is not waited for: its flush forces
            # at once, as any flush, and recovers first)
            if planned and arrived is not None and not self.survivable(ex.error):
                # every rank that learned of the plan flushes now: force once all have begun
                # (one execution), or go on as any flush once an execution completes
                left = None if deadline is None else max(deadline - loop.time(), 0.0)
                # a few of this rank's steps (the others come within about one), at most
                # PLAN_PATIENCE: should a rank not say so (a loss that split the ranks' flushes)
                # the flush goes on as any flush, not stalls
                patience = min(PLAN_PATIENCE, max(0.2, 3 * self._gap))
                patience = patience if left is None else min(left, patience)
                done, _ = await asyncio.wait({arrived, ex.current}, timeout=patience,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:  # (nobody should be that late: flush as any flush does)
                    log.warning("rank %d: planned flush of partial allreduce %r: not every "
                                "rank said it began after %.0f s; forcing an execution",
                                self.rank, self.name, patience)
            while True:
                if self.survivable(ex.error):  # a rank was lost: go on without it
                    await self._survive()
                    ex, P, forced = self._ex, self.world_size, False
                    # said again in the new world (its key agreed again: the ranks that
                    # begin this flush only now say so there, and wait for this rank's)
                    self._say_arrived()
                if self._flushing_seen == P:  # (it completed while this rank waited above)
                    break
                cur = ex.completed + 1
                if not forced and self._state[SNAPSHOTS] <= cur:
                    self._force(cur)
                    forced = True
                left = None if deadline is None else max(deadline - loop.time(), 0.0)
                try:
                    await self._await(ex.current, left, cur)
                except PeerLostError as exc:
                    if not self.survivable(exc):
                        raise
                    continue
                if self._flushing_seen == P:
                    break
            self._flushing_seen = 0  # everyone left their flush at this execution
            self._planned_seen = 0  # (and began it after their plan)
            with self._lock:
                c = self._round
                assert c > self._given
                self._last_flush = c
                return self._take(True, c - self._given - 1, dest)
        finally:
            self._state[FLUSHING] = 0
            self._busy = False


def _cancelling(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` finished or was asked to cancel (``Task.cancelling``, Python 3.11+)."""
    cancelling = getattr(task, "cancelling", None)
    return task.done() or (cancelling is not None and cancelling() > 0)
