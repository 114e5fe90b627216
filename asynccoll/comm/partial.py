"""The persistent partial-allreduce handle: call semantics, results and flush.

A :class:`PartialAllreduce` owns one persistent executor of a partial allreduce schedule and
a contribution strategy (:mod:`.contribution`: dense arrays or sparse vectors) that builds the
schedule, holds the send buffer the schedule snapshots and keeps the results. Its state lives
on the runtime's loop (the progress thread by default); the public coroutines bridge to it.
The rules (issue 4, DESIGN §5), for a call ``h(x)`` on rank r:

1. If an execution completed since r was last given a result, the call returns at once with
   the latest result (``included=False``; with ``accumulate`` the sum of every result not
   yet given) and ``x`` is added to the send buffer for a later execution.
2. Otherwise ``x`` is added to the send buffer and r takes part in the current execution e:
   it starts e when r is in S(e) (for quorum and deadline: it announces its arrival), else it
   waits for an external activation; it returns e's result with ``included=True``.

**Deadline** and what a call is handed: :mod:`.partial_results`. **Routes, shared memory and
lost ranks**: :mod:`.partial_member`.

Corner case of 2: if e was already activated on r from outside (its snapshot taken, maybe of
an empty buffer) before ``x`` arrived, ``x`` cannot be in e any more. The call then waits for e
(already under way, so only for the time the collective itself takes) and returns e's result
with ``included=False``; ``x`` stays in the send buffer for e + 1.

A call that rule 1 answers does not cross to the runtime's loop (no thread hop, no wake-up of
the progress thread): it takes the result and adds its data to the send buffer on the caller's
thread, under the handle's lock. The snapshot kernel and the completion callback take the same
lock on the loop, so a contribution is in exactly one execution (the snapshot moves the whole
send buffer into the execution and resets it atomically) and a result is never handed out
half written. Every other call, and every call made on the runtime's loop, runs there.

On timeout or cancellation of a call its data stays in the send buffer (to be contributed
later, not lost); if the awaited execution still completes, its result is handed out by the
next call (``included=False``) or flush.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any

import numpy as np

from ..collectives import KERNELS as COLLECTIVE_KERNELS
from ..collectives.partial import (
    ARRIVAL_KINDS,
    ARRIVED,
    COUNT,
    DSIG,
    FRESH,
    SHM_ATTACH,
    SNAPSHOTS,
    TAG_FORCE,
    DeadlineConfig,
    activation,
    arrival_stamp,
    call_rule,
    deadline_signature,
    initiators,
    signature_sum,
)
from ..collectives.policy import Policy
from ..errors import (
    BusyError,
    ExecutionError,
    PeerLostError,
)
from ..results import PartialResult
from ..sched import Executor, LiveOps, Schedule
from ..transport.base import Transport
from . import clock
from .contribution import Combine
from .partial_flush import FlushSide
from .partial_member import Survives, locked_snapshots, stable_id
from .plan import HandlePlan, HandleRuntime
from .shm import PartialSegments

__all__ = ["Combine", "PartialAllreduce", "stable_id"]

log = logging.getLogger("asynccoll.comm")

_NONE: frozenset[int] = frozenset()


class PartialAllreduce(FlushSide):
    """A persistent partial allreduce (solo, majority, two-choice, quorum or deadline); see
    the module doc.

    Made by :meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`,
    on the runtime's loop, from a ``runtime`` (the communicator's engine, transport, trace
    writer, kernels, live-op registry, ``stall_warn``: :class:`~.plan.HandleRuntime`), a
    :class:`~asynccoll.Policy` (``ValueError`` when it does not fit the world) and a ``plan``
    (:class:`~.plan.HandlePlan`: the ``contribution`` strategy that fits ``like``, dense or
    sparse, :mod:`asynccoll.comm.contribution`; name, seed, accumulation, timeout).
    ``await h(x)`` returns a :class:`~asynccoll.PartialResult`; ``await h.flush()`` is the
    collective that drains every contribution. One call at a time per handle
    (:class:`~asynccoll.BusyError` otherwise). With the plan's ``shm_token`` (a dense
    contribution whose data phase goes through shared memory) this rank's segments are
    created here (:class:`~.shm.PartialSegments`; ``OSError`` when they cannot be).
    """

    #: the call the warning of a handle closed holding contributions advises (the training
    #: classes and torch wrappers set theirs); None: a shortcut's, which has no flush to
    #: advise, so its leftovers are said at INFO (missing the last execution is by design)
    flush_hint: str | None = "'await h.flush()' on the handle"

    def __init__(self, runtime: HandleRuntime, policy: Policy, plan: HandlePlan) -> None:
        transport, contribution, like = runtime.transport, plan.contribution, plan.like
        kernels, live, shm_token = runtime.kernels, runtime.live, plan.shm_token
        self._engine = runtime.engine
        self._writer = runtime.trace
        self._contribution = contribution
        #: the straggler policy (:mod:`asynccoll.collectives.policy`)
        self.policy = policy
        act = policy.activation(transport.world_size)  # ValueError when it does not fit P
        self.kind = act.kind
        self.name = name = plan.name
        self.op = contribution.op
        #: what a call that missed results is given (:class:`~asynccoll.Accumulate`;
        #: :class:`~asynccoll.train.EagerSGD` sets ``WORLD``: a survivor may receive a result
        #: of the world before a loss after it; :mod:`.survival`)
        self.accumulate = plan.accumulate
        quorum = act.quorum
        self.quorum = quorum
        #: the deadline kind's parameters (None for other kinds)
        self.deadline_config: DeadlineConfig | None = act.deadline
        self.seed = plan.seed
        timeout, stall_warn = plan.timeout, runtime.stall_warn
        self.timeout = timeout
        self.stall_warn = stall_warn
        self.rank = transport.rank
        self.world_size = transport.world_size
        P = self.world_size
        self._like = like
        #: seconds added to this rank's clock for arrival stamps (rank 0's clock; set by the
        #: communicator, :mod:`.clock`)
        self.clock_offset = 0.0
        #: how the handle goes on without a lost rank (set by the communicator when it
        #: survives; :mod:`.survival`), else None
        self._survival: Survives | None = None
        sched, bufs = contribution.build(like, self.rank, P, self.kind, quorum)
        self.shape = contribution.shape
        self.dtype = contribution.dtype
        self.algorithm = contribution.algorithm
        self._meta = bufs["meta"]
        self._state = bufs["state"]
        self.schedule = sched
        self.sched_id = stable_id(name, 0)
        self._given = -1
        self._round = -1  # the latest completed execution whose result is kept
        self._value: Any = None  # latest result (or the sum since given), not yet handed out
        self._vmeta = np.zeros(len(self._meta), np.int64)
        self._stamps = slice(2 * P + 2, 3 * P + 2)  # the arrival stamps in the meta vector
        #: while the kept value is a result of the world before a rebuild (never handed out):
        #: that world's size (``_vmeta`` is in its layout) and the new rank of each of its
        #: ranks (-1: lost); see :meth:`rebuild`
        self._vold: tuple[int, list[int]] | None = None
        dc = self.deadline_config
        self._state[DSIG] = deadline_signature(dc)
        #: the deadline (seconds) the next execution uses; the spreads it comes from
        self.next_deadline: float | None = None if dc is None else dc.hi
        self._spreads: collections.deque[float] = collections.deque(
            maxlen=1 if dc is None else dc.window)
        self._deadline_of: dict[int, float] = {}  # execution -> the deadline it used
        self._first_stamp = 0  # the latest completed execution's first arrival stamp (0: none)
        self._wait_stamp = 0  # the waiting call's arrival stamp
        self._wait_round = -1
        self._wait_result: PartialResult | None = None
        self._wait_dest: tuple[Any, Any] | None = None  # the waiting call's out= (_take)
        self._wait_included = False
        # the latest results handed to calls: (the result, its raw value, its meta, ``_given``
        # before it), so that a call cancelled after the take can give its result back
        # (:meth:`_give_back`; it does so within a loop turn or two)
        self._takes: collections.deque[tuple[PartialResult, Any, Any, int]] = \
            collections.deque(maxlen=16)
        self._busy = False
        self._owner: asyncio.Task[Any] | None = None  # the call or flush that holds the handle
        self._closed = False
        self._flushing_seen = 0  # ranks flushing in the latest completed execution
        self._planned_seen = 0  # ranks that planned a flush, in the latest completed execution
        self._last_flush = -1  # the round at which the last flush ended (the same everywhere)
        self._last_call, self._gap = 0.0, 1.0  # (:meth:`_note_gap`)
        self._plan_sid = stable_id(f"{name}#flush", 1)  # the flushes' "began" messages
        # Guards the send buffer, the kept result and the call state between the caller's
        # thread (rule-1 calls) and the runtime's loop (snapshots, completions, other calls).
        self._lock = threading.RLock()
        self._kernels = locked_snapshots(COLLECTIVE_KERNELS if kernels is None else kernels,
                                          self._lock, self._snapped)
        #: the shared-memory segments of the data phase (:mod:`.shm`), or None (network)
        self._segments: PartialSegments | None = None
        self._bufs = bufs
        self._transport = transport
        self._live = live
        #: the route agreed (:meth:`_agree_route`) before the first execution, when the data
        #: phase was to go through shared memory; None: nothing to agree
        self._route: asyncio.Future[None] | None = None
        if not contribution.shm:
            self._arm(self._executor(transport, sched, bufs, live, 0))
            return
        if shm_token is None:
            raise ValueError("a shared-memory partial allreduce needs the job's segment "
                             "token (shm_token)")
        refused: OSError | None = None
        spec = sched.slots["mine"]
        assert spec.count is not None
        self._kernels[SHM_ATTACH] = self._attach  # (binds nothing without segments)
        try:
            self._segments = PartialSegments(shm_token, self.sched_id, self.rank, P, spec.count,
                                             spec.dtype, parts=contribution.segment_sets)
        except OSError as exc:  # a name taken, too little free space, a foreign file
            refused = exc
            # this executor never runs (the route goes to the network): zeros that take no
            # memory until touched stand for the segments
            for slot, sp in sched.slots.items():
                if slot not in bufs:
                    bufs[slot] = np.zeros(sp.count or 0, np.dtype(sp.dtype or "u1"))
        else:
            bufs.update(self._segments.buffers(0))
        # Not armed before every rank said whether its segments exist: the executor is there
        # (its error, its completed count) but posts nothing; peers' first messages wait in
        # the transport until it does.
        self._ex = self._executor(transport, sched, bufs, live, 0)
        self._start_route(refused)

    def _executor(self, transport: Transport, sched: Schedule, bufs: dict[str, Any],
                  live: LiveOps | None, first: int) -> Executor:
        """The persistent executor of ``sched`` over ``transport``, numbering its executions
        from ``first``."""
        trace = self._writer
        sink = None if trace is None else trace.add_schedule(
            sched, self.sched_id, collective=f"{self.kind}_allreduce", kind=self.kind,
            handle=self.name, quorum=self.quorum, seed=self.seed)
        # not armed yet (:meth:`_arm`): an execution that completes at once, its messages
        # already in, must find the executor in ``self._ex``
        ex = Executor(sched, transport, bufs, sched_id=self.sched_id, persistent=False,
                      on_complete=self._on_complete, trace_sink=sink, kernels=self._kernels,
                      first_execution=first)
        if self.kind not in ARRIVAL_KINDS:  # who may start an execution: named in warnings
            ex.initiators = self._initiators
        if live is not None:
            live.add(ex, trace)
        return ex

    def _arm(self, ex: Executor) -> None:
        """Make ``ex`` this handle's executor, then arm it (persistent from now on)."""
        self._ex = ex
        ex.persistent = True
        ex.current  # noqa: B018  (arms the first execution: receives posted)

    # -- public, from any loop ---------------------------------------------------------------
    async def __call__(self, x: Any, timeout: float | None = None, *,
                       combine: Combine | None = None, out: Any = None) -> PartialResult:
        """Contribute ``x`` (shape and dtype of ``like``); see the module doc for the rules.

        ``out`` (dense handles): an array of ``like``'s shape and dtype that receives the
        result's value (``res.value is out``), as ``comm.allreduce``'s ``out=``. Without it
        every result is a fresh array, whose first touch costs page faults (at 16 MiB about
        25 ms per call on the development machine, where the whole 16 MiB majority call took
        90 ms); with it the handle reuses its own result buffer. Do not touch ``out`` until
        the call returns.

        ``combine(acc, x, n, late) -> int`` (optional; it runs under the handle's lock,
        atomically with respect to snapshots, on the caller's thread or the runtime's)
        replaces "add ``x`` to the send buffer": ``acc`` is the flat send buffer holding ``n``
        local contributions (0: the identity), ``x`` the flat data, ``late`` whether ``x``
        cannot be in the execution whose result this call returns; it writes ``acc`` in place
        and returns how many contributions ``acc`` now holds (0 only if ``acc`` holds the
        identity). Training methods use it to drop late data or to weight stale data.

        Raises ``ValueError``/``TypeError`` naming ``x`` for a wrong array,
        :class:`~asynccoll.BusyError` when a call or flush of this handle is under way,
        :class:`~asynccoll.CollectiveTimeoutError` (naming the ops and ranks awaited) after
        ``timeout`` seconds (default: the communicator's), ``ExecutionError`` when the
        execution failed (mismatched shapes across ranks, say), ``TransportClosedError``
        after close.
        """
        dest = None if out is None else (out, self._contribution.check_out(out))
        if not self._engine.on_loop():
            res = self._answer_now(x, combine, dest)
            if res is not None:
                return res
        res = await self._engine.run(self._call(x, timeout, combine, dest),
                                     orphan=self._give_back)
        if dest is not None:
            self._recycle(res)
        return res

    def blocking(self, x: Any, timeout: float | None = None, *,
                 out: Any = None) -> PartialResult:
        """``h(x)`` for code without an event loop (needs a progress thread; a call that
        rule 1 answers stays on the caller's thread)."""
        dest = None if out is None else (out, self._contribution.check_out(out))
        if self._engine.mode == "thread" and not self._engine.on_loop():
            res = self._answer_now(x, None, dest)
            if res is not None:
                return res
        res = self._engine.run_blocking(self._call(x, timeout, None, dest))
        if dest is not None:
            self._recycle(res)
        return res

    def flush_blocking(self, timeout: float | None = None) -> PartialResult:
        """:meth:`flush` for code without an event loop (needs a progress thread)."""
        return self._engine.run_blocking(self._flush(timeout))

    async def close(self) -> None:
        """Stop this handle on this rank (local, not collective): a call or flush under way
        fails with :class:`~asynccoll.TransportClosedError`, and so does every later one;
        contributions not yet sent are dropped. Idempotent; ``comm.close()`` closes every
        handle of the communicator."""
        await self._engine.run(self._close())

    @property
    def completed(self) -> int:
        """The last execution completed on this rank (-1 before the first)."""
        return self._ex.completed

    def __repr__(self) -> str:
        c = self._contribution
        return (f"{c.label}({self.kind!r}, name={self.name!r}, {c.describe()}, "
                f"rank={self.rank}/{self.world_size})")

    # -- on the loop -------------------------------------------------------------------------
    def _check(self, x: Any) -> Any:
        self._check_open()
        flat = self._contribution.check(x)
        if self._busy:
            raise BusyError(f"partial allreduce {self.name!r} already has a call or flush "
                            "under way; one at a time per handle")
        self._owner = asyncio.current_task()
        return flat

    def _answer_now(self, x: Any, combine: Combine | None,
                    dest: tuple[Any, Any] | None = None) -> PartialResult | None:
        """Rule 1 on the caller's thread: the result and the data's deposit, or ``None`` when
        the call must go to the loop (no execution completed since the last result)."""
        self._check_open()
        flat = self._contribution.check(x)
        with self._lock:
            # busy: the loop says BusyError, or finds the call ahead of it gone (cancelled)
            rule = call_rule(self._round, self._given, int(self._state[SNAPSHOTS]))
            if not rule.answer_now or self._busy or self._closed:
                return None
            self._note_late(arrival_stamp(clock.now() + self.clock_offset))
            self._add(flat, combine, True)
            res = self._take(False, rule.missed, dest)
            if dest is not None:
                self._recycle(res)  # handed to the caller right here
            return res

    async def _call(self, x: Any, timeout: float | None, combine: Combine | None = None,
                    dest: tuple[Any, Any] | None = None) -> PartialResult:
        await self._after_cancelled()
        flat = self._check(x)
        self._note_gap()
        if self._route is not None:
            self._busy = True
            try:
                await self._routed(timeout)
            finally:
                self._busy = False
        while self.survivable(self._ex.error) and self._round <= self._given:
            # lost a rank since the last call (and nothing to hand out): go on without it
            self._busy = True
            try:
                await self._survive()
            finally:
                self._busy = False
        ex = self._ex
        timer: asyncio.TimerHandle | None = None
        with self._lock:
            rule = call_rule(self._round, self._given, int(self._state[SNAPSHOTS]))
            stamp = arrival_stamp(clock.now() + self.clock_offset)
            if rule.answer_now:
                self._note_late(stamp)
                self._add(flat, combine, True)
                return self._take(False, rule.missed, dest)
            cur, late = rule.execution, rule.late
            self._add(flat, combine, late)
            # Set before start(): a world of one completes the execution inside start().
            self._wait_round = cur
            self._wait_included = not late  # late: activated from outside before x arrived
            self._wait_stamp = stamp
            self._wait_dest = dest
            self._busy = True
            if not late:
                self._state[FRESH] = 1
                self._state[ARRIVED] = stamp
        fut = ex.current  # execution cur's completion
        try:
            how = None if late else activation(
                self.rank in initiators(self.kind, cur, self.world_size, self.seed),
                bool(self._flushing_seen))
            if how == "force":
                self._force(cur)
            elif not late:
                if self.next_deadline is not None:
                    timer = asyncio.get_running_loop().call_later(
                        self.next_deadline, self._expire, cur)
                if how == "start":
                    ex.start()
            while True:
                try:
                    await self._await(fut, timeout, cur)
                    break
                except PeerLostError as exc:
                    if not self.survivable(exc):
                        raise
                    await self._survive()
                    if self._wait_result is not None:
                        break  # execution cur was settled: its result is this call's
                    fut = self._rejoin(cur, stamp)
        except BaseException:
            with self._lock:
                if self._wait_result is None:
                    self._state[FRESH] = 0
                else:  # the execution completed, but nobody will receive its result
                    self._give_back(self._wait_result)
                    self._wait_result = None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._busy = False
            self._wait_round = -1
            self._wait_dest = None
        res, self._wait_result = self._wait_result, None
        assert res is not None
        return res

    def _on_complete(self, e: int) -> None:
        # Runs inside the executor right after execution e completes and before it re-arms:
        # copy the result out, since the next snapshot overwrites ``data``.
        with self._lock:
            self._complete(e)
        if self._segments is not None:
            self._shm_next(e)

    def _complete(self, e: int) -> None:
        c = self._contribution
        c.unpack_meta()
        if self._survival is not None:
            self._survival.after_complete(e, *self.result_buffers())
        P = self.world_size
        if signature_sum(self._meta, P) != P * (c.signature ^ int(self._state[DSIG])):
            raise ExecutionError(
                f"rank {self.rank}: the ranks disagree on partial allreduce {self.name!r} "
                f"(kind, op, quorum, deadline, shape, dtype or algorithm differ; this rank "
                f"has {self.kind}, op={self.op}, quorum={self.quorum}, shape={self.shape}, "
                f"dtype={self.dtype}"
                + ("" if self.deadline_config is None else f", {self.deadline_config}") + ")")
        self._keep()
        self._round = e
        if self.next_deadline is not None:
            self._adapt(e)
        self._flushing_seen = int(self._meta[2 * self.world_size + 1])
        self._planned_seen = int(self._meta[3 * self.world_size + 3])
        if self._writer is not None:
            self._trace_extra(e)
        if e == self._wait_round:
            self._wait_result = self._take(self._wait_included, 0, self._wait_dest)

    def _initiators(self, e: int) -> frozenset[int]:
        return initiators(self.kind, e, self.world_size, self.seed)

    def _force(self, e: int) -> None:
        """Activate execution ``e`` here from outside the initiator set (a message to self;
        if it fails, the caller times out naming the execution)."""
        self._ex.activate(e, TAG_FORCE)

    async def _close(self) -> None:
        if not self._closed:
            with self._lock:
                self._closed = True
            if self._survival is not None:
                self._survival.cancel()
            if self._route is not None:
                self._route.cancel()
            left = int(self._state[COUNT])
            if left and self._ex.error is None and self.flush_hint is None:
                log.info("rank %d: shortcut partial allreduce %r closed holding %d "
                         "contribution(s) that no execution took (a shortcut has no flush; "
                         "a handle's does: h = comm.partial_allreduce(kind, like=x))",
                         self.rank, self.name, left)
            elif left and self._ex.error is None:
                log.warning("rank %d: partial allreduce %r closed holding %d contribution(s) "
                            "that no execution took; call %s before closing to include them",
                            self.rank, self.name, left, self.flush_hint)
            self._ex.close()  # a waiting call fails with TransportClosedError
            self._shm_close()
