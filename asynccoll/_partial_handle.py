"""The persistent partial-allreduce handle: call semantics, results and flush.

A :class:`PartialAllreduce` owns one persistent executor of
:func:`~asynccoll.collectives.partial.build_partial_allreduce` and the send buffer it snapshots.
Its state lives on the runtime's loop (the progress thread by default); the public coroutines
bridge to it. The rules (issue 4, DESIGN §5), for a call ``h(x)`` on rank r:

1. If an execution completed since r was last given a result, the call returns at once with
   the latest result (``included=False``; with ``accumulate=True`` the sum of every result not
   yet given) and ``x`` is added to the send buffer for a later execution.
2. Otherwise ``x`` is added to the send buffer and r takes part in the current execution e:
   it starts e when r is in S(e) (for quorum: it announces its arrival), else it waits for an
   external activation; it returns e's result with ``included=True``.

Corner case of 2: if e was already activated on r from outside (its snapshot taken, maybe of
an empty buffer) before ``x`` arrived, ``x`` cannot be in e any more. The call then waits for e
(already under way, so only for the time the collective itself takes) and returns e's result
with ``included=False``; ``x`` stays in the send buffer for e + 1.

A contribution is in exactly one execution: the snapshot moves the whole send buffer into the
execution and resets it, atomically on the loop. On timeout or cancellation of a call its data
stays in the send buffer (to be contributed later, not lost); if the awaited execution still
completes, its result is handed out by the next call (``included=False``) or flush.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np

from ._progress import ProgressEngine
from .buffers import check_array, empty_like, is_cupy, reduce_into
from .collectives.dense import allreduce as dense_allreduce
from .collectives.dense import scratch_buffers
from .collectives.partial import (
    COUNT,
    FORCED,
    FRESH,
    SNAPSHOTS,
    STATE_LEN,
    TAG_FORCE,
    build_partial_allreduce,
    identity,
    initiators,
    signature,
)
from .errors import BusyError, CollectiveTimeoutError, ExecutionError, TransportClosedError
from .results import PartialResult
from .sched import Executor
from .transport.base import PROTOCOL_VERSION, Format, Header, Kind, Transport

__all__ = ["PartialAllreduce", "stable_id"]


def stable_id(text: str, space: int) -> int:
    """A 60-bit id of ``text`` in id space ``space`` (0-3): equal on every rank and run."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return ((4 + space) << 60) | (h & ((1 << 60) - 1))


class PartialAllreduce:
    """A persistent partial allreduce (solo, majority, two-choice or quorum); see module doc.

    Made by :meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`,
    on the runtime's loop. ``await h(x)`` returns a :class:`~asynccoll.PartialResult`;
    ``await h.flush()`` is the collective that drains every contribution. One call at a time
    per handle (:class:`~asynccoll.BusyError` otherwise).
    """

    def __init__(self, engine: ProgressEngine, transport: Transport, *, kind: str, like: Any,
                 op: str, accumulate: bool, quorum: int | None, seed: int, name: str,
                 algorithm: str | None = None, timeout: float | None = None) -> None:
        self._engine = engine
        self._transport = transport
        self.kind = kind
        self.name = name
        self.op = op
        self.accumulate = accumulate
        self.quorum = quorum
        self.seed = seed
        self.timeout = timeout
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.shape: tuple[int, ...] = tuple(like.shape)
        self.dtype = np.dtype(like.dtype)
        count = int(like.size)
        P = self.world_size
        sched = build_partial_allreduce(self.rank, P, count, self.dtype, kind=kind, op=op,
                                        quorum=quorum, algorithm=algorithm)
        self.schedule = sched
        flat_like = like.reshape(-1)
        self._acc = empty_like(flat_like)
        self._acc.fill(identity(op, self.dtype))
        self._data = empty_like(flat_like)
        self._meta = np.zeros(2 * P + 2, np.int64)
        self._sig = signature(kind, op, quorum, count, self.dtype, algorithm)
        self._state = np.zeros(STATE_LEN, np.int64)
        self.sched_id = stable_id(name, 0)
        self._flush_id = stable_id(name, 1)
        bufs = {"acc": self._acc, "data": self._data, "meta": self._meta, "state": self._state}
        bufs.update(scratch_buffers(sched))
        if is_cupy(flat_like):  # the data's scratch on the device, meta's on the host
            bufs.update({k: v for k, v in scratch_buffers(sched, flat_like).items()
                         if not k.startswith("meta_")})
        self._given = -1
        self._round = -1  # the latest completed execution whose result is kept
        self._value: Any = None  # latest result (or the sum since given), not yet handed out
        self._vmeta = np.zeros(2 * P + 2, np.int64)
        self._wait_round = -1
        self._wait_result: PartialResult | None = None
        self._wait_included = False
        self._busy = False
        self._closed = False
        self._flush_ex: Executor | None = None
        self._flush_buf = np.zeros(1, np.int64)
        self._ex = Executor(sched, transport, bufs, sched_id=self.sched_id, persistent=True,
                            on_complete=self._on_complete)

    # -- public, from any loop ---------------------------------------------------------------
    async def __call__(self, x: Any, timeout: float | None = None) -> PartialResult:
        """Contribute ``x`` (shape and dtype of ``like``); see the module doc for the rules.

        Raises ``ValueError``/``TypeError`` naming ``x`` for a wrong array,
        :class:`~asynccoll.BusyError` when a call or flush of this handle is under way,
        :class:`~asynccoll.CollectiveTimeoutError` (naming the ops and ranks awaited) after
        ``timeout`` seconds (default: the communicator's), ``ExecutionError`` when the
        execution failed (mismatched shapes across ranks, say), ``TransportClosedError``
        after close.
        """
        return await self._engine.run(self._call(x, timeout))

    async def flush(self, timeout: float | None = None) -> PartialResult:
        """Collective and synchronous: drain every contribution; return what was not given.

        Every rank must call it (after its last call of the handle). Each rank forces an
        execution that snapshots all it still holds (bypassing the initiator set and the
        quorum), then the ranks agree on the last execution any of them saw complete and wait
        for it. Afterwards no contribution is left in any send buffer and no execution is under
        way. Returns the latest result (``accumulate=True``: the sum of all results not yet
        given), ``included=True``. It also releases calls of other ranks still waiting for an
        initiator that has stopped calling (majority, two-choice, quorum at the end of
        training). Costs one to two executions plus a one-element allreduce.
        """
        return await self._engine.run(self._flush(timeout))

    def blocking(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``h(x)`` for code without an event loop (needs a progress thread)."""
        return self._engine.run_blocking(self._call(x, timeout))

    def flush_blocking(self, timeout: float | None = None) -> PartialResult:
        """:meth:`flush` for code without an event loop (needs a progress thread)."""
        return self._engine.run_blocking(self._flush(timeout))

    @property
    def completed(self) -> int:
        """The last execution completed on this rank (-1 before the first)."""
        return self._ex.completed

    def __repr__(self) -> str:
        return (f"PartialAllreduce({self.kind!r}, name={self.name!r}, shape={self.shape}, "
                f"dtype={self.dtype}, op={self.op!r}, rank={self.rank}/{self.world_size})")

    # -- on the loop -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"partial allreduce {self.name!r} is closed")
        # A failed persistent executor does not re-arm; its error ends the handle.
        err = getattr(self._ex, "_error", None)
        if err is not None:
            raise err

    def _check(self, x: Any) -> Any:
        self._check_open()
        check_array(x, "x")
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"x must have shape {self.shape} and dtype {self.dtype} like the "
                             f"handle, got shape {tuple(x.shape)} and dtype {x.dtype}")
        if self._busy:
            raise BusyError(f"partial allreduce {self.name!r} already has a call or flush "
                            "under way; one at a time per handle")
        return x.reshape(-1)

    def _add(self, flat: Any) -> None:
        if is_cupy(self._acc) and not is_cupy(flat):
            raise TypeError("x must be a CuPy array like the handle's")
        reduce_into(self.op, self._acc, flat)
        self._state[COUNT] += 1

    async def _call(self, x: Any, timeout: float | None) -> PartialResult:
        flat = self._check(x)
        ex = self._ex
        c = ex.completed
        if c > self._given:
            self._add(flat)
            return self._take(False, c - self._given)
        cur = c + 1
        fut = ex.current  # execution cur's completion
        self._add(flat)
        # Set before start(): a world of one completes the execution inside start().
        self._wait_round = cur
        self._busy = True
        try:
            if self._state[SNAPSHOTS] > cur:
                self._wait_included = False  # activated from outside before x arrived
            else:
                self._wait_included = True
                self._state[FRESH] = 1
                if self.rank in initiators(self.kind, cur, self.world_size, self.seed):
                    ex.start()
            await self._await(fut, timeout, cur)
        except BaseException:
            if self._wait_result is None:
                self._state[FRESH] = 0
            raise
        finally:
            self._busy = False
            self._wait_round = -1
        res, self._wait_result = self._wait_result, None
        assert res is not None
        return res

    async def _await(self, fut: asyncio.Future[int], timeout: float | None, e: int) -> None:
        t = self.timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(asyncio.shield(fut), t)
        except asyncio.TimeoutError:
            pend = self._ex.pending()
            who = sorted(initiators(self.kind, e, self.world_size, self.seed))
            raise CollectiveTimeoutError(
                f"rank {self.rank}: {self.kind} allreduce {self.name!r} execution {e} not "
                f"complete after {t} s (initiators {who if self.kind != 'quorum' else 'any'}"
                f"{'' if self.quorum is None else f', quorum {self.quorum}'}); waiting on: "
                + "; ".join(d for _, _, d in pend), pend) from None

    def _on_complete(self, e: int) -> None:
        # Runs inside the executor right after execution e completes and before it re-arms:
        # copy the result out, since the next snapshot overwrites ``data``.
        if self._meta[2 * self.world_size] != self.world_size * self._sig:
            raise ExecutionError(
                f"rank {self.rank}: the ranks disagree on partial allreduce {self.name!r} "
                f"(kind, op, quorum, shape, dtype or algorithm differ; this rank has "
                f"{self.kind}, op={self.op}, quorum={self.quorum}, shape={self.shape}, "
                f"dtype={self.dtype})")
        if self._value is None:
            self._value = self._data.copy()
            self._vmeta[...] = self._meta
        elif self.accumulate:
            reduce_into(self.op, self._value, self._data)
            self._vmeta += self._meta
        else:
            self._value[...] = self._data  # never handed out, so nobody sees it change
            self._vmeta[...] = self._meta
        self._round = e
        if e == self._wait_round:
            self._wait_result = self._take(self._wait_included, 0)

    def _take(self, included: bool, missed: int) -> PartialResult:
        value, self._value = self._value, None
        assert value is not None
        self._given = self._round
        return PartialResult.from_meta(value.reshape(self.shape), self._round, included,
                                       self._vmeta, self.world_size, missed)

    def _force(self, e: int) -> None:
        """Activate execution ``e`` here from outside the initiator set: a message to self."""
        h = Header(PROTOCOL_VERSION, int(Kind.ACTIVATION), self.sched_id, e, TAG_FORCE,
                   self.rank, "", (), int(Format.RAW), 0)
        self._state[FORCED] = 1  # e's snapshot is the next one: e is not activated here yet
        fut = self._transport.post_send(self.rank, h, b"")
        # A failed self-send leaves the execution unforced; the flush then times out naming it.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _flush(self, timeout: float | None) -> PartialResult:
        self._check_open()
        if self._busy:
            raise BusyError(f"partial allreduce {self.name!r} already has a call or flush "
                            "under way")
        self._busy = True
        loop = asyncio.get_running_loop()
        t = self.timeout if timeout is None else timeout
        deadline = None if t is None else loop.time() + t

        def left() -> float | None:
            return None if deadline is None else max(deadline - loop.time(), 0.0)

        ex = self._ex
        try:
            cur = ex.completed + 1
            if self._state[SNAPSHOTS] > cur:  # under way: let it finish first
                await self._await(ex.current, left(), cur)
            cur = ex.completed + 1
            self._force(cur)
            while ex.completed < cur:
                await self._await(ex.current, left(), ex.completed + 1)
            last = await self._agree_max(ex.completed, left())
            while ex.completed < last:
                await self._await(ex.current, left(), ex.completed + 1)
            c = ex.completed
            if c > self._given:
                return self._take(True, c - self._given - 1)
            raise AssertionError("flush completed an execution but has no result")
        finally:
            self._busy = False

    async def _agree_max(self, value: int, timeout: float | None) -> int:
        if self._flush_ex is None:
            s = dense_allreduce(self.rank, self.world_size, 1, np.int64, "max")
            self._flush_ex = Executor(s, self._transport, {"data": self._flush_buf,
                                                           **scratch_buffers(s)},
                                      sched_id=self._flush_id)
        self._flush_buf[0] = value
        self._flush_ex.start()
        await self._flush_ex.wait(timeout)
        return int(self._flush_buf[0])

    def _close(self) -> None:
        """Stop (on the loop): a waiting call fails with TransportClosedError."""
        if self._closed:
            return
        self._closed = True
        self._ex.close()
        if self._flush_ex is not None:
            self._flush_ex.close()
