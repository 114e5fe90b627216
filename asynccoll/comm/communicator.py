"""The Communicator: the awaitable collective API of one process (DESIGN §6).

``comm = await asynccoll.connect()`` (:func:`asynccoll.launch.connect`) joins the job the
environment describes (or the one given by arguments) and returns a :class:`Communicator`;
``async with comm:`` closes it. The Communicator itself never reads the environment.

**Results are new arrays.** ``await comm.allreduce(x)`` returns a new array and leaves ``x``
alone, as the functional collectives of torch.distributed and mpi4py's lowercase methods do; a
partial collective returns a :class:`~asynccoll.PartialResult` whose ``value`` is new too.
Torch tensors go wherever arrays go and come back as tensors (:mod:`.tensors`: CPU tensors
without copies, CUDA tensors through DLPack, non-contiguous ones refused).

**Ordering.** Synchronous collectives must be called in the same order on every rank (the MPI
rule): schedules are identified by the order in which each distinct ``(collective, count,
dtype, op, algorithm)`` first appears, and each is built and committed once, then reused.
At that first use the ranks compare a hash of the definition (one 16-byte allreduce), so ranks
that disagree on ``op`` or ``root`` get an ExecutionError instead of different results.
Persistent partial handles are identified by a stable hash of their name (by default their
order of creation, shortcuts included), so create them in the same order on every rank or name
them; ranks that disagree on a handle's definition get an ExecutionError.

**Progress.** With ``progress="thread"`` (the default of :func:`connect`) the runtime runs on a
loop in a progress thread, so external activations are answered and contributions sent while
the application computes; the coroutines bridge to the caller's loop, and ``comm.blocking``
offers the same collectives for code without a loop. ``progress="inline"`` runs on the caller's
loop (cheaper by a thread hop per call, but a busy application delays everyone waiting on it).

**Errors.** Bad arguments raise ``TypeError``/``ValueError`` naming the argument; mismatched
shapes or dtypes across ranks raise :class:`~asynccoll.ExecutionError`; a collective that does
not finish within ``timeout`` seconds raises :class:`~asynccoll.CollectiveTimeoutError` naming
the ops and ranks still awaited; anything after :meth:`Communicator.close` raises
:class:`~asynccoll.TransportClosedError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from ..buffers import check_array, check_out
from ..collectives import KERNELS, dense
from ..collectives._plan import check_op
from ..collectives.dense import block_bounds
from ..errors import PeerLostError, TransportClosedError
from ..sched import DumpSignal, KernelRegistry, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
from . import clock, groups
from .blocking import BlockingCollectives
from .dense import DenseOps
from .handles import PartialCollectives, as_kind, avg_op
from .hier_partial import HierPartialAllreduce
from .membership import DEFAULT_CLOSE_TIMEOUT, Membership
from .partial import PartialAllreduce
from .progress import ProgressEngine
from .route import Router, Switches
from .sparse import SparseOps
from .stall import DEFAULT_STALL_WARN
from .tensors import TensorKind, from_tensor

__all__ = ["Communicator"]

T = TypeVar("T")

log = logging.getLogger("asynccoll.comm")

#: communicators not closed yet (closed in order at interpreter exit: :func:`_close_at_exit`)
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Close, in order, every communicator a program left open when it ends normally.

    A program that ends without closing its communicator (no ``async with``) used to leave as
    a lost rank: a peer still inside its last collective (a barrier whose exit this rank had
    passed first, say) failed with ``PeerLostError`` (about one run in five of a three-rank
    job under load). So at exit each open communicator on a progress thread closes as
    :meth:`Communicator.close` does (goodbyes, serving the peers until each has closed, at
    most its ``close_timeout``), all at once so that ranks sharing a process do not wait for
    one another: ``MPI_Finalize``'s contract, which ``mpi4py`` also applies at exit. Not
    after an uncaught exception (the interpreter keeps it as ``sys.last_value``): a crashed
    rank leaves at once and its peers learn of the loss at once, as from a killed one. Runs
    before the progress threads are stopped (``atexit`` runs the last registered first, and
    this module imports :mod:`.progress`). Inline communicators are not closed: their loop
    ended with ``asyncio.run``."""
    if getattr(sys, "last_value", None) is not None or \
            getattr(sys, "last_exc", None) is not None:
        return
    # Only this process's own, on a progress thread still running: a process forked after
    # connect() inherits the communicators but not the thread (their loop runs nowhere).
    pid = os.getpid()
    closing = [(c, f) for c in list(_OPEN) if (f := c.close_at_exit(pid)) is not None]
    if not closing:
        return
    deadline = time.monotonic() + max(c.close_timeout for c, _ in closing) + 5.0
    for _, f in closing:
        with contextlib.suppress(Exception):  # exiting: a failed close cannot be reported
            f.result(max(0.0, deadline - time.monotonic()))


class Communicator(PartialCollectives):
    """Collectives over a connected ``transport`` for its rank; see the module doc.

    ``progress``: the engine whose loop the transport lives on (default: inline on the running
    loop). ``timeout``: the default of every collective's ``timeout`` (``None``: wait forever).
    ``close_transport``: whether :meth:`close` closes the transport. ``trace``: a directory to
    write this rank's execution trace to (``rank-R.jsonl``, read by ``asynccoll inspect``);
    it costs about a JSON line per execution. ``kernels``: the kernel registry every executor
    of this communicator runs with, :attr:`kernels` (default: a copy of
    :data:`asynccoll.collectives.KERNELS`, into which you may register your own).

    Every executor it builds is added to :attr:`live`, its live-op registry. Created on the
    main thread of its process, it installs a ``SIGUSR1`` handler that dumps what they wait
    on (to stderr, and as ``pending`` snapshots into the trace file when tracing) without
    stopping the process: ``asynccoll inspect pending DIR --pid PID`` sends it. The handler
    found at creation is called after it, and :meth:`close` puts it back. Created on another
    thread (where Python cannot install signal handlers), it installs none and ``SIGUSR1``
    keeps its previous meaning (by default: terminate); ``comm.live.dump()`` still works.
    Constructing a Communicator costs no I/O (but opening the trace file).
    """

    def __init__(self, transport: Transport, *, progress: ProgressEngine | None = None,
                 timeout: float | None = None, close_transport: bool = True,
                 trace: str | None = None, kernels: KernelRegistry | None = None,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
                 stall_warn: float | None = DEFAULT_STALL_WARN, survive: bool = False,
                 _child: bool = False, _switches: Switches | None = None) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a Transport, got {type(transport).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout!r}")
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) \
                or not close_timeout >= 0:
            raise ValueError(f"close_timeout must be seconds >= 0, got {close_timeout!r}")
        self.transport = transport
        self._engine = (progress or ProgressEngine.inline()).acquire()
        self.timeout = timeout
        #: how long :meth:`close` waits for the other ranks to close too (seconds)
        self.close_timeout = float(close_timeout)
        if stall_warn is not None and not stall_warn > 0:
            raise ValueError(f"stall_warn must be seconds > 0 or None, got {stall_warn!r}")
        #: seconds a collective waits before it warns that it still waits (then at doubling
        #: intervals), naming the ops and ranks it waits for; None: never
        self.stall_warn = stall_warn
        self._close_transport = close_transport
        #: whether partial collectives go on without a lost rank (:mod:`.survival`); the
        #: default of every partial handle's ``survive``
        self.survive = bool(survive)
        self._next_id = itertools.count(1)
        #: the kernels of every executor this communicator builds
        self.kernels: KernelRegistry = KERNELS.extended() if kernels is None else kernels
        #: the executors this communicator built, for dumps of what they wait on
        self.live = LiveOps()
        self._sparse = SparseOps(transport, lambda: next(self._next_id), kernels=self.kernels,
                                 live=self.live)
        self._handles: dict[str, PartialAllreduce] = {}
        self._hier_handles: dict[str, HierPartialAllreduce] = {}  # algorithm="hier"
        self._shortcuts: dict[tuple[Any, ...], PartialAllreduce] = {}
        self._auto_names: dict[str, int] = {}
        self._closed = False
        self.blocking = BlockingCollectives(self, self._engine, self._close_blocking,
                                            self._shortcut_blocking)
        self._writer: TraceWriter | None = None
        self._trace = trace
        #: the groups made from this communicator (closed before it), and how many were made
        self._children: list[Communicator] = []
        self._groups_made = 0
        self._group_key = "world"
        self._shrunk: Communicator | None = None
        self._parent: Communicator | None = None
        self._closes_parent = False  # the first world of a job that may grow (first_world)
        self._closing = False  # close() under way (its groups closing first)
        self._released = False  # gave its hold on the progress engine back
        self._pid = os.getpid()
        _OPEN.add(self)
        #: seconds this rank adds to its clock to read rank 0's (:meth:`sync_clocks`)
        self.clock_offset = 0.0
        self._clock_syncs = 0
        if trace is not None:
            self._writer = TraceWriter(trace, transport.rank, transport.world_size)
        self._dense = DenseOps(transport, lambda: next(self._next_id), kernels=self.kernels,
                               live=self.live, writer=self._writer, stall_warn=self.stall_warn,
                               router=Router(transport.world_size,
                                             _switches or Switches.from_env()))
        self._sparse.dense = self._dense  # its host layout and segments (shared memory)
        self._dense.lost = lambda: self.membership.lost
        self._dump_signal: DumpSignal | None = None
        if not _child and threading.current_thread() is threading.main_thread() \
                and hasattr(signal, "SIGUSR1"):
            self._dump_signal = self.live.install_signal_handler(loop=self._engine.loop)
        #: who is in the job: losses learned and told, goodbyes at close
        self.membership = Membership(transport, self.live)
        if self.size > 1:
            self._engine.call(lambda: self.membership.watch(lambda: self._closed))

    # -- identity and lifecycle --------------------------------------------------------------
    @property
    def trace_writer(self) -> TraceWriter | None:
        """Where this communicator's executors record their executions (``trace=``), or
        None."""
        return self._writer

    @property
    def progress(self) -> str:
        """``"thread"`` or ``"inline"``."""
        return self._engine.mode

    @property
    def lost(self) -> PeerLostError | None:
        """The first loss of a rank this rank learned of (``None`` while every rank is there).

        A rank that sees a peer's connection break (a crash, a kill, a close without goodbye)
        tells every other rank at once, so every rank learns of a lost rank within a round
        trip, however far from it, and the error names the rank lost. From then on every
        collective under way fails, and every new one raises, with :class:`PeerLostError`
        naming it (a synchronous collective cannot complete without it; ``close()`` still
        works). Costs nothing while no rank is lost: one receive posted per peer.
        """
        return self.membership.lost

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called; every collective raises after it."""
        return self._closed

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, "
                f"transport={self.transport.scheme!r}, progress={self.progress!r})")

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, tp: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an exception is an abort: do not keep the peers waiting for our goodbye;
        # they learn of it as a lost peer at once. The flight record (the last collectives)
        # goes to the trace, or to the log, first.
        if tp is not None and not self._closed:
            self._record_flight(f"exit after {tp.__name__}: {exc[0]!r}")
        await self.close(timeout=None if tp is None else 0)

    def _record_flight(self, reason: str) -> None:
        try:
            text, written = self._engine.call(lambda: self.live.record_flight(reason))
        except Exception as err:  # a failing record must not hide the exception leaving
            log.debug("rank %d: no flight record: %r", self.rank, err)
            return
        if not written and text:
            log.warning("rank %d: %s; the last collectives:\n%s", self.rank, reason, text)

    async def close(self, timeout: float | None = None) -> None:
        """Close collectively and in order, as ``MPI_Finalize`` does; idempotent.

        Every rank should call it (``async with`` does) after its last collective. Until
        every other rank has closed too (or is lost), this rank keeps serving them: its
        persistent partial collectives still answer activations and contribute, so a rank
        that finishes first never makes a slower one's last collective fail, and an orderly
        exit is never reported as a loss. It then waits for the executions under way here to
        complete, logs a warning for each partial handle that still holds contributions no
        execution took (call ``await h.flush()`` before closing to include them), cancels what
        is left (waiting calls fail with TransportClosedError), closes the transport and stops
        the progress thread. ``timeout``: the most it waits for the other ranks (default
        :attr:`close_timeout`, 30 s unless set; ``0``: close at once, as on an exception
        inside ``async with``).
        """
        if self._closed:
            return
        parent = self._parent
        if self._closes_parent and parent is not None and not parent._closing:  # noqa: SLF001
            # the first world of a job that may grow: the job's communicator closes it, after
            # the grown communicators its handles run on now (their goodbyes first)
            await parent.close(timeout)
            return
        self._closing = True
        # one deadline for the groups and this communicator: ``timeout`` bounds the whole wait
        # (each group waited the whole of it in turn)
        deadline = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        for child in sorted(self._children, key=lambda c: c._closes_parent):  # noqa: SLF001
            await child.close(max(0.0, deadline - time.monotonic()))
        self._closed = True
        if self._dump_signal is not None:
            self._dump_signal.restore()
        wait = max(0.0, deadline - time.monotonic())
        try:
            if not self._engine.closed:
                await self._engine.run(self._close_on_loop(wait))
        finally:
            if not self._engine.on_loop():
                self._release_closed()

    def _release_closed(self) -> None:
        """Give back the holds on the progress engine of this communicator and of every group
        made from it that is closed: one closed on the engine's loop does not give its own
        back (it cannot stop the thread it runs on)."""
        for c in self._tree():
            if c._closed:  # noqa: SLF001 - a communicator of its own class
                c._release_once()  # noqa: SLF001

    def _release_once(self) -> None:
        """Give back this communicator's hold on the progress engine (once)."""
        if not self._released:
            self._released = True
            self._engine.release()

    def _tree(self) -> list[Communicator]:
        """This communicator and every group made from it, and from those."""
        out = [self]
        for child in self._children:
            out += child._tree()  # noqa: SLF001 - a communicator of its own class
        return out

    def close_at_exit(self, pid: int) -> concurrent.futures.Future[None] | None:
        """The interpreter's exit hook's part (:func:`_close_at_exit`): when this is process
        ``pid``'s own outermost communicator, open, on a progress thread still running, start
        :meth:`close` there and return its future (signal handlers put back first, on this,
        the main thread); else None."""
        engine = self._engine
        if self._closed or self._parent is not None or self._pid != pid \
                or not engine.thread_alive or engine.closed:
            return None
        if self._dump_signal is not None:
            with contextlib.suppress(Exception):
                self._dump_signal.restore()
            self._dump_signal = None
        try:
            return asyncio.run_coroutine_threadsafe(self.close(), engine.loop)
        except Exception:  # a loop already stopping: nothing to say
            return None

    def _close_blocking(self, timeout: float | None = None) -> None:
        """:meth:`close` for code without an event loop (``comm.blocking.close()``)."""
        if self._closed:
            return
        if self._dump_signal is not None:
            self._dump_signal.restore()  # on this thread, which may be the main one
        try:
            if not self._engine.closed:
                # on the loop: close does not release
                self._engine.run_blocking(self.close(timeout))
        finally:
            self._closed = True
            # closed on the loop: this one, its groups (a grown communicator among them),
            # and the job's when it closed with this one
            parent = self._parent
            root = parent if self._closes_parent and parent is not None else self
            root._release_closed()  # noqa: SLF001 - a communicator of its own class

    async def _close_on_loop(self, wait: float = 0.0) -> None:
        if wait > 0 and self.size > 1 and not self.transport.closed:
            await self.membership.goodbye(wait)
        elif self.size > 1 and isinstance(self.transport, groups.GroupTransport) \
                and not self.transport.closed:
            # an abort: the parent's connections stay up, so say so, as a broken one would
            self.membership.announce_leaving()
        self.membership.stop()
        for h in self._handles.values():
            await h.close()
        for hh in self._hier_handles.values():
            await hh.close()
        self._dense.close()
        self._sparse.close()
        if self._close_transport:
            await self.transport.close()
        if self._writer is not None:
            self._writer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("communicator is closed")
        lost = self.membership.lost
        if lost is not None:
            raise PeerLostError(lost.rank, lost.reason)


    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise TransportClosedError("communicator is closed")
        return await self._engine.run(coro)

    async def sync_clocks(self, rounds: int = 8, timeout: float | None = None) -> float:
        """Estimate this rank's clock offset to rank 0's (:mod:`.clock`) and use it from now
        on for arrival stamps (``PartialResult.arrivals``, ``lateness``) and in the trace.
        Collective; :func:`~asynccoll.connect` calls it once. Returns the offset (seconds)."""
        self._check_open()
        wait = 30.0 if timeout is None else timeout
        if not self._clock_syncs:
            # the host layout comes along once, so that partial handles, made without a
            # collective, can choose shared memory the same way on every rank
            await self._run(self._dense.hosts(wait))
        first = self._clock_syncs << 16  # past every ping of an earlier exchange
        self._clock_syncs += 1
        off = await self._run(clock.estimate_offset(self.transport, rounds, wait, first))
        self.clock_offset = off
        for h in self._handles.values():
            h.clock_offset = off
        if self._writer is not None:
            self._writer.write({"type": "clock", "offset": off, "rounds": rounds})
        return off

    def _make_group(self, members: list[int], key: str) -> Communicator:
        view = groups.GroupTransport(self.transport, members, key)
        trace = None if self._trace is None else os.path.join(
            self._trace, f"group{self._groups_made - 1}-{groups.describe(members)}")
        child = Communicator(view, progress=self._engine, timeout=self.timeout, trace=trace,
                             kernels=self.kernels, close_timeout=self.close_timeout,
                             stall_warn=self.stall_warn, survive=self.survive, _child=True,
                             _switches=self._dense.router.switches)
        child._group_key = key
        child._parent = self
        child._dense.inherit_hosts(self._dense, members, key)
        child.clock_offset = self.clock_offset
        if child._writer is not None and self.clock_offset:
            child._writer.write({"type": "clock", "offset": self.clock_offset})
        done = [c for c in self._children if c.closed]
        self._children = [c for c in self._children if not c.closed]
        for c in done:  # closed on the loop without giving its hold back (this one holds too)
            c._release_once()  # noqa: SLF001 - a communicator of its own class
        self._children.append(child)
        gone = [(g, r) for g, r in enumerate(members) if r in self.membership.gone]
        if gone:  # lost before the group was made: lost to it too

            def learn() -> None:
                for g, r in gone:
                    child.membership.learn(PeerLostError(g, f"rank {r} of the parent was "
                                                         "lost"), tell=False)
            self._engine.call(learn)
        return child

    # -- synchronous collectives -------------------------------------------------------------
    async def allreduce(self, x: Any, op: str = "sum", algorithm: str | None = None,
                        timeout: float | None = None, *, out: Any = None) -> Any:
        """Reduce ``x`` element-wise over all ranks and return the result.

        ``op``: ``sum``, ``prod``, ``min``, ``max``, or ``avg`` (the sum divided by P, for
        floating-point data only; as torch.distributed's ``ReduceOp.AVG``). ``algorithm``:
        ``recursive_doubling``, ``ring``, ``rabenseifner``, ``shm`` (through shared memory,
        every rank on one host, one-shot or two-shot by size: :mod:`asynccoll.comm.shm`;
        ``shm_one_shot`` / ``shm_two_shot`` force one) or ``None``: ``shm`` from 128 KiB
        up when every rank is on this host, else chosen by size and P. Every rank ends with
        bitwise identical results. By default the result is a new array
        (``x`` is left as it is), which costs an allocation and a copy of ``x``; ``out=``
        names a contiguous array of ``x``'s shape and dtype to hold it instead, and ``out=x``
        reduces in place with neither (as ``torch.distributed.all_reduce`` and
        ``MPI_IN_PLACE`` do). Do not touch ``out`` until the call returns. Raises
        ``ValueError``/``TypeError`` naming ``out`` when it does not fit. ``x`` and ``out``
        may be torch tensors (:mod:`asynccoll.comm.tensors`): the result is then a tensor.
        """
        given_out = out
        x_in = x
        x, kind = from_tensor(x, "x")
        okind: TensorKind | None = None
        if out is not None:
            out, okind = (x, kind) if out is x_in else from_tensor(out, "out")
        _check_x(x)
        op, average = avg_op(op, x)
        check_op(op)
        if out is None:
            buf = _flat_copy(x)
        else:
            buf = check_out(out, x)
        await self._run(self._dense_allreduce(buf, op, algorithm, timeout))
        if average:
            buf /= self.size
        if out is None:
            res = buf.reshape(x.shape)
            return res if kind is None else kind.wrap(res)
        if okind is not None:
            okind.write_back(given_out, out)
            return given_out
        return out

    async def broadcast(self, x: Any, root: int = 0, timeout: float | None = None, *,
                        out: Any = None) -> Any:
        """Return a new array holding ``root``'s ``x`` (every rank passes the same shape).

        ``out=`` (a NumPy array as ``allreduce``'s) holds it instead, ``out=x``: in place, as
        ``torch.distributed.broadcast``; a failed call leaves part of ``root``'s data there."""
        x, kind = from_tensor(x, "x")
        _check_x(x)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root!r}")
        if out is None:
            buf = _flat_copy(x)
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
            buf = check_out(out, x, copy=self.rank == root)
        key = ("broadcast", buf.size, buf.dtype.str, int(root))
        await self._run(self._dense_call(key, lambda: dense.broadcast(
            self.rank, self.size, buf.size, buf.dtype, int(root)), buf, timeout))
        return out if out is not None else as_kind(buf.reshape(x.shape), kind)

    async def allgather(self, x: Any, timeout: float | None = None) -> Any:
        """Return a new array of shape ``(P, *x.shape)``: row r is rank r's ``x``."""
        x, kind = from_tensor(x, "x")
        _check_x(x)
        n = int(x.size)
        out = np.empty((self.size, n), x.dtype) if isinstance(x, np.ndarray) \
            else _empty_like(x, (self.size, n))
        out[self.rank] = x.reshape(-1)
        flat = out.reshape(-1)
        key = ("allgather", n, flat.dtype.str)
        await self._run(self._dense_call(key, lambda: dense.allgather(
            self.rank, self.size, n, flat.dtype), flat, timeout))
        return as_kind(out.reshape((self.size, *x.shape)), kind)

    async def reduce_scatter(self, x: Any, op: str = "sum",
                             timeout: float | None = None) -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of the flattened result.

        Blocks follow ``numpy.array_split``'s rule (the first ``x.size % P`` blocks have one
        element more), so with P dividing ``x.size`` it is MPI_Reduce_scatter_block. Returns a
        new 1-D array. ``op="avg"`` divides the sum by P (floating-point data only).
        """
        x, kind = from_tensor(x, "x")
        _check_x(x)
        op, average = avg_op(op, x)
        check_op(op)
        work = _flat_copy(x)
        key = ("reduce_scatter", work.size, work.dtype.str, op)
        await self._run(self._dense_call(key, lambda: dense.reduce_scatter(
            self.rank, self.size, work.size, work.dtype, op), work, timeout))
        b = block_bounds(work.size, self.size)
        res = work[b[self.rank]:b[self.rank + 1]].copy()
        if average:
            res /= self.size
        return as_kind(res, kind)

    async def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32,
                    timeout: float | None = None) -> Any:
        """A new NumPy array in shared memory that every rank of this host maps
        (collective: every rank calls it with the same shape and dtype, in the same order;
        every rank on one host, else ``ValueError``). ``allreduce(x, out=x)`` of such an array
        reduces it where it is, with no copy in or out: each rank reduces its block of every
        rank's array and writes it into each (:mod:`asynccoll.comm.shm`), the fastest
        allreduce on one host; fill it before the call and do not write it during one. The
        peers write into it only during an allreduce of it (after one that failed or timed out
        on this rank, peers still in it may write into it until they fail or complete: its
        contents are undefined until then). It lives until the communicator closes, its
        memory freed with the last reference; nothing is left in ``/dev/shm``.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self._check_open()
        return await self._run(self._dense.shared_empty(
            shape, dtype, self.timeout if timeout is None else timeout))

    async def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float32,
                    timeout: float | None = None) -> Any:
        """:meth:`empty`, filled with zeros."""
        a = await self.empty(shape, dtype, timeout)
        a.fill(0)
        return a

    async def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        await self._run(self._dense_call(("barrier",), lambda: dense.barrier(
            self.rank, self.size), None, timeout))

    async def _dense_allreduce(self, buf: Any, op: str, algorithm: str | None,
                               timeout: float | None) -> None:
        self._check_open()
        await self._dense.allreduce(buf, op, algorithm, self.timeout if timeout is None
                                    else timeout)

    async def _dense_call(self, key: tuple[Any, ...], build: Callable[[], Schedule],
                          data: Any, timeout: float | None) -> None:
        self._check_open()
        await self._dense.call(key, build, data, self.timeout if timeout is None else timeout)


def _check_x(x: Any) -> None:
    check_array(x, "x")


def _flat_copy(x: Any) -> Any:
    return x.reshape(-1).copy()


def _empty_like(x: Any, shape: tuple[int, ...]) -> Any:
    import cupy

    return cupy.empty(shape, x.dtype)

