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
import hashlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar, overload

import numpy as np

from ..buffers import check_array
from ..collectives import KERNELS, dense
from ..collectives._plan import check_op
from ..collectives.dense import block_bounds
from ..collectives.partial import check_deadline, check_kind
from ..collectives.sparse.schedules import choose_algorithm
from ..collectives.sparse.streams import SparseVector
from ..errors import CollectiveTimeoutError, PeerLostError, TransportClosedError
from ..results import PartialResult
from ..sched import DumpSignal, KernelRegistry, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
from . import clock, groups
from .blocking import BlockingCollectives
from .contribution import Contribution, DenseContribution, SparseContribution
from .dense import DenseOps
from .hier_partial import HierPartialAllreduce
from .membership import DEFAULT_CLOSE_TIMEOUT, Membership
from .partial import PartialAllreduce, stable_id
from .progress import ProgressEngine
from .route import Router, Switches, shm_flag
from .sparse import SparseAllreduceHandle, SparseOps, as_host, to_device
from .stall import DEFAULT_STALL_WARN
from .survival import Survival
from .tensors import TensorKind, TensorPartialAllreduce, from_tensor, wrap_result

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


class Communicator:
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
    def rank(self) -> int:
        """This process's rank, 0..size-1."""
        return self.transport.rank

    @property
    def size(self) -> int:
        """The world size P."""
        return self.transport.world_size

    @property
    def hosts(self) -> list[list[int]]:
        """The ranks of each host, this communicator's ranks, hosts in the order of their
        lowest rank (its leader, ``hosts[i][0]``, the rank the hierarchical collectives cross
        the network from); learned at connect (every rank's host identity: host name and
        boot id, or ``ASYNCCOLL_HOST_ID``), inherited by groups; ``[]`` where it is not known
        (a communicator made without :func:`~asynccoll.connect` before its first shared-memory
        collective)."""
        layout = self._dense.layout
        return [] if layout is None else layout.groups

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
        # one deadline for the groups and this communicator: ``timeout`` bounds the whole wait
        # (each group waited the whole of it in turn)
        deadline = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        for child in self._children:
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
                self._engine.release()

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
            self._engine.release()

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

    # -- groups (sub-communicators) and shrinking ---------------------------------------------
    async def split(self, color: int | str | None, key: int | None = None,
                    timeout: float | None = None) -> Communicator | None:
        """A sub-communicator of the ranks that pass the same ``color`` (``MPI_Comm_split``).

        Collective over this communicator: every rank calls it, in the same order among its
        collectives. ``color``: an int >= 0; ``"host"`` for the ranks of this host (its
        identity as the shared-memory path sees it, ``ASYNCCOLL_HOST_ID`` included: MPI's
        ``Comm_split_type(SHARED)``); or ``None`` to take part without joining any group
        (MPI's ``UNDEFINED``; returns ``None``). Ranks in the new group are ordered by ``key``
        (default: this rank), ties by this communicator's rank. The group shares this
        communicator's connections (:mod:`asynccoll.comm.groups`); it costs one allgather of
        two integers. Close it with ``await group.close()`` (collective over the group), or
        let this communicator's ``close`` close it first.
        """
        self._check_open()
        if color == "host":
            from .shm import host_hash
            c = host_hash()
        elif color is None:
            c = -1
        elif isinstance(color, bool) or not isinstance(color, (int, np.integer)) \
                or not 0 <= color < 1 << 63:
            raise ValueError(f"color must be an int in 0..2**63-1, 'host' or None, got "
                             f"{color!r}")
        else:
            c = int(color)
        if key is None:
            key = self.rank
        elif isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"key must be an int or None, got {key!r}")
        elif not -(1 << 63) <= key < 1 << 63:
            raise ValueError(f"key must fit in int64, got {key!r}")
        got = await self.allgather(np.array([c, int(key)], np.int64), timeout)
        colors, keys = got[:, 0].tolist(), got[:, 1].tolist()
        n = self._groups_made
        self._groups_made += 1
        if c < 0:
            return None
        members = groups.split_members(colors, keys, c)
        return self._make_group(members, f"{self._group_key}/{n}:{c}")

    async def group(self, ranks: Any, timeout: float | None = None) -> Communicator | None:
        """A sub-communicator of ``ranks`` (this communicator's ranks; group rank i is
        ``ranks[i]``), as ``torch.distributed.new_group(ranks)`` and Horovod's process sets.

        Collective over this communicator: every rank calls it with the same ``ranks``, in the
        same order among its collectives; ranks outside the group get ``None``. Ranks that pass
        different ``ranks`` all get a ``ValueError`` (one allgather of a hash compares them).
        Raises ``ValueError``/``TypeError`` naming ``ranks`` when they are not distinct ranks.
        """
        self._check_open()
        members = groups.group_members(ranks, self.size)
        digest = _members_hash(members)
        got = await self.allgather(np.array([digest], np.int64), timeout)
        n = self._groups_made
        self._groups_made += 1
        if len(set(got[:, 0].tolist())) != 1:
            differ = sorted(r for r in range(self.size) if int(got[r, 0]) != digest)
            raise ValueError(f"ranks: the ranks passed different groups to group() (ranks "
                             f"{differ} differ from rank {self.rank}'s {members})")
        if self.rank not in members:
            return None
        return self._make_group(members, f"{self._group_key}/{n}:{digest}")

    async def shrink(self, timeout: float | None = None) -> Communicator:
        """A communicator of the ranks not lost (MPI ULFM's ``MPIX_Comm_shrink``).

        After a :class:`~asynccoll.PeerLostError`, every survivor calls it; they agree on the
        set of lost ranks (the same set on every survivor, even when several ranks died at once
        or a survivor comes late: :meth:`Membership.agree <.membership.Membership.agree>`) and
        each gets a new communicator of the others, ranked in their old order, over the
        connections that remain. Returns the same communicator when called again. Raises
        :class:`~asynccoll.PeerLostError` when the survivors decided that this rank is lost,
        :class:`~asynccoll.CollectiveTimeoutError` after ``timeout`` seconds (default: the
        communicator's timeout).
        """
        if self._closed:
            raise TransportClosedError("communicator is closed")
        if self._shrunk is not None and not self._shrunk.closed:
            return self._shrunk
        wait = self.timeout if timeout is None else timeout

        async def agree() -> frozenset[int]:
            try:
                return await asyncio.wait_for(self.membership.agree(), wait)
            except asyncio.TimeoutError:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the survivors did not agree within {wait} s "
                    f"(lost so far: {sorted(self.membership.gone)})") from None

        lost = await self._run(agree())
        if self.rank in lost:
            raise PeerLostError(self.rank, "the survivors decided this rank is lost")
        if self._shrunk is not None and not self._shrunk.closed:
            return self._shrunk  # another task's shrink() made it while this one waited
        members = [r for r in range(self.size) if r not in lost]
        self._groups_made += 1
        # The key from agreed data only: a loss can leave the survivors with different counts
        # of groups made (a split that completed on some of them), never with different lost
        # sets.
        self._shrunk = self._make_group(
            members, f"{self._group_key}/shrink:{_members_hash(sorted(lost))}")
        log.info("rank %d: shrunk to %d ranks (lost %s); rank %d of the new communicator",
                 self.rank, len(members), sorted(lost), self._shrunk.rank)
        return self._shrunk

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
        self._children = [c for c in self._children if not c.closed]
        self._children.append(child)
        gone = [(g, r) for g, r in enumerate(members) if r in self.membership.gone]
        if gone:  # lost before the group was made: lost to it too

            def learn() -> None:
                for g, r in gone:
                    child.membership.learn(PeerLostError(g, f"rank {r} of the parent was "
                                                         "lost"), tell=False)
            self._engine.call(learn)
        return child

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the job (the outermost communicator) that make up this communicator,
        in rank order: ``range(size)`` for the job itself, the members of a group else."""
        t = self.transport
        chain = []
        while isinstance(t, groups.GroupTransport):
            chain.append(t.members)
            t = t.parent
        out = tuple(range(t.world_size))
        for m in reversed(chain):
            out = tuple(out[r] for r in m)
        return out

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
        op, average = _avg_op(op, x)
        check_op(op)
        if out is None:
            buf = _flat_copy(x)
        else:
            check_array(out, "out", writable=True)
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"out must have x's shape {x.shape} and dtype {x.dtype}, got "
                                 f"{out.shape} and {out.dtype}")
            if out is not x:
                out[...] = x
            buf = out.reshape(-1)
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

    async def broadcast(self, x: Any, root: int = 0, timeout: float | None = None) -> Any:
        """Return a new array holding ``root``'s ``x`` (every rank passes the same shape)."""
        x, kind = from_tensor(x, "x")
        _check_x(x)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root!r}")
        out = _flat_copy(x)
        key = ("broadcast", out.size, out.dtype.str, int(root))
        await self._run(self._dense_call(key, lambda: dense.broadcast(
            self.rank, self.size, out.size, out.dtype, int(root)), out, timeout))
        return _as_kind(out.reshape(x.shape), kind)

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
        return _as_kind(out.reshape((self.size, *x.shape)), kind)

    async def reduce_scatter(self, x: Any, op: str = "sum",
                             timeout: float | None = None) -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of the flattened result.

        Blocks follow ``numpy.array_split``'s rule (the first ``x.size % P`` blocks have one
        element more), so with P dividing ``x.size`` it is MPI_Reduce_scatter_block. Returns a
        new 1-D array. ``op="avg"`` divides the sum by P (floating-point data only).
        """
        x, kind = from_tensor(x, "x")
        _check_x(x)
        op, average = _avg_op(op, x)
        check_op(op)
        work = _flat_copy(x)
        key = ("reduce_scatter", work.size, work.dtype.str, op)
        await self._run(self._dense_call(key, lambda: dense.reduce_scatter(
            self.rank, self.size, work.size, work.dtype, op), work, timeout))
        b = block_bounds(work.size, self.size)
        res = work[b[self.rank]:b[self.rank + 1]].copy()
        if average:
            res /= self.size
        return _as_kind(res, kind)

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

    async def sparse_allreduce(self, x: Any, density: float | None = None,
                               algorithm: str | None = None, quantize: int | None = None,
                               timeout: float | None = None, *, delta: float | None = None,
                               bucket: int = 512, seed: int = 0) -> Any:
        """Sum sparse (or sparsified dense) ``x`` over all ranks (SparCML; docs/sparse.md).

        ``x``: a :class:`~asynccoll.SparseVector`, or an array whose nonzeros are this rank's
        contribution (CuPy is staged through host memory; the result comes back as CuPy).
        ``density``: the expected fraction of nonzeros per rank, the same on every rank, to
        choose the algorithm; ``algorithm`` (``ssar_recursive_double``,
        ``ssar_split_allgather``, ``dsar_split_allgather``) overrides it. ``quantize``: 2, 4
        or 8 QSGD bits for the dense stage (implies ``dsar_split_allgather``; ``bucket``
        entries per scale, ``seed`` for the rounding). ``delta``: the switch point to dense.

        Returns a new :class:`~asynccoll.SparseVector` (sorted unique indices, no exact zeros)
        while the sum fits the sparse form, else a new dense array (shaped like ``x`` when
        ``x`` is an array; DSAR always returns it dense); every rank gets the same type and
        bitwise the same values. Call it in the same order on every rank, like the other
        collectives: the schedule of each distinct (size, dtype, algorithm, quantize, delta,
        bucket, seed) is built once and reused. Raises ``TypeError``/``ValueError`` naming
        ``x``, ``density``, ``algorithm``, ``quantize`` or ``delta``,
        :class:`~asynccoll.CollectiveTimeoutError` after ``timeout`` seconds (default: the
        communicator's), ``ExecutionError`` when ranks disagree on the vector.
        """
        self._check_open()
        x, kind = from_tensor(x, "x")
        host, device = as_host(x)
        if isinstance(host, np.ndarray) and not host.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous (got strides {host.strides})")
        dt = host.values.dtype if isinstance(host, SparseVector) else host.dtype
        alg = self._sparse.resolve(int(host.size), np.dtype(dt), density, algorithm, quantize,
                                   delta)
        t = self.timeout if timeout is None else timeout
        agree = None if self.size == 1 else (
            lambda what: self._dense.agree_on("sparse_allreduce", what, t))
        res = await self._run(self._sparse.run(host, algorithm=alg, quantize=quantize,
                                               delta=delta, bucket=bucket, seed=seed,
                                               timeout=t, agree=agree))
        if isinstance(res, np.ndarray) and not isinstance(x, SparseVector):
            res = res.reshape(x.shape)
        res = to_device(res) if device else res
        return res if isinstance(res, SparseVector) else _as_kind(res, kind)

    def sparse_allreduce_handle(self, size: int, dtype: Any = np.float32, *,
                                name: str | None = None, density: float | None = None,
                                algorithm: str | None = None, quantize: int | None = None,
                                delta: float | None = None, bucket: int = 512, seed: int = 0,
                                timeout: float | None = None,
                                shm: bool | None = None) -> SparseAllreduceHandle:
        """A persistent sparse allreduce ``h`` of length-``size`` vectors of ``dtype``:
        ``await h(x)`` sums ``x`` as :meth:`sparse_allreduce` does, with the schedule built
        once for the handle's life (for a training loop's every step).

        ``name`` identifies the handle across ranks (its schedule id derives from it, so the
        handle stays out of the order of the other collectives; default: the order of
        creation of sparse handles). ``density``, ``algorithm``, ``quantize``, ``delta``,
        ``bucket``, ``seed``: as for :meth:`sparse_allreduce`, fixed per handle; ``timeout``:
        the default per call (default: the communicator's). ``await h.close()`` frees it;
        ``comm.close()`` closes it.

        ``shm``: whether the data goes through this host's shared memory, as
        :meth:`sparse_allreduce`'s does (docs/sparse.md, *On one host: shared memory*), with a
        partial handle's segments (made here, mapped at the first call, nothing left in
        ``/dev/shm`` after it, nor after a SIGKILL of one rank once a survivor learns of it).
        ``None`` (the default): when every rank is on this host, the algorithm is a split one
        and not quantised, ``ASYNCCOLL_SHM`` is not ``0`` and ``/dev/shm`` is large enough for
        every rank's segment twice over (its size, the same on every rank, not what is free).
        ``True``: asks for it (``ssar_split_allgather`` when no ``algorithm`` is given and the
        chooser's pick is not a split one; ``ValueError`` naming ``shm`` where it cannot be).
        ``False``: over the network. ``h.shm`` says which. As for partial handles, nothing
        checks that the ranks chose alike: give every rank the same ``shm``, ``algorithm`` and
        ``ASYNCCOLL_SHM`` (ranks that differ time out at the first call, whose
        ``CollectiveTimeoutError`` says so and names this rank's path).

        Raises ``ValueError`` naming ``name`` (in use), ``density``, ``algorithm``,
        ``quantize``, ``delta``, ``size`` or ``shm``; ``OSError`` (ENOSPC naming the fix) where
        this rank's segment cannot be created (``/dev/shm`` full of other segments: give
        ``shm=False``). Costs the schedule's construction and, through shared memory, creating
        this rank's segment; no I/O with the peers.
        """
        self._check_open()
        dt = np.dtype(dtype)
        shm = shm_flag(shm)
        alg = self._sparse.resolve(int(size), dt, density, algorithm, quantize, delta)
        token: int | None = None
        if quantize is not None:
            if shm is True:
                raise ValueError("shm=True: a quantised sparse allreduce goes over the network "
                                 "(quantisation is for fewer bytes on a network); give "
                                 "quantize=None or shm=None")
        else:
            alg, token = self._dense.router.sparse_partial(self._dense.layout, alg, algorithm,
                                                           shm)
        name = self._handle_name(name, "sparse")
        sid = stable_id(name, 3)
        entry = self._engine.call(lambda: self._sparse.named(
            name, sid, int(size), dt, algorithm=alg, quantize=quantize, delta=delta,
            bucket=bucket, seed=seed, shm_token=token))
        t = self.timeout if timeout is None else timeout
        return SparseAllreduceHandle(entry, name, run=self._run, release=self._sparse.release,
                                     timeout=t)

    def _handle_name(self, name: str | None, kind: str) -> str:
        """``name`` checked, or the next of ``kind#0``, ``kind#1``, ... by order of creation."""
        if name is None:
            # By order of creation only: ranks that disagree on the arguments then share a
            # schedule id and get an ExecutionError instead of waiting on each other forever.
            n = self._auto_names.get(kind, 0)
            self._auto_names[kind] = n + 1
            return f"{kind}#{n}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        return name

    # -- partial collectives -----------------------------------------------------------------
    @overload
    def partial_allreduce(self, kind: str, like: Any, op: str = ...,
                          accumulate: bool | str = ..., quorum: int | None = ...,
                          seed: int | None = ..., name: str | None = ..., *,
                          algorithm: Literal["hier"], timeout: float | None = ...,
                          density: float | None = ..., delta: float | None = ...,
                          deadline: float | tuple[float, float] | None = ...,
                          mad_factor: float | None = ..., deadline_window: int | None = ...,
                          survive: bool | None = ..., shm: bool | None = ...
                          ) -> HierPartialAllreduce: ...

    @overload
    def partial_allreduce(self, kind: str, like: Any, op: str = ...,
                          accumulate: bool | str = ..., quorum: int | None = ...,
                          seed: int | None = ..., name: str | None = ...,
                          algorithm: str | None = ..., timeout: float | None = ..., *,
                          density: float | None = ..., delta: float | None = ...,
                          deadline: float | tuple[float, float] | None = ...,
                          mad_factor: float | None = ..., deadline_window: int | None = ...,
                          survive: bool | None = ..., shm: bool | None = ...
                          ) -> PartialAllreduce: ...

    def partial_allreduce(self, kind: str, like: Any, op: str = "sum",
                          accumulate: bool | str = False,
                          quorum: int | None = None, seed: int | None = None,
                          name: str | None = None, algorithm: str | None = None,
                          timeout: float | None = None, *, density: float | None = None,
                          delta: float | None = None,
                          deadline: float | tuple[float, float] | None = None,
                          mad_factor: float | None = None,
                          deadline_window: int | None = None,
                          survive: bool | None = None,
                          shm: bool | None = None) -> PartialAllreduce | HierPartialAllreduce:
        """A persistent partial allreduce handle ``h``: ``await h(x) -> PartialResult``.

        ``kind``: ``solo`` (any rank's call starts an execution), ``majority`` (one drawn rank
        per execution), ``two_choice`` (two drawn ranks, the first to arrive), ``quorum``
        (starts once ``quorum`` ranks have arrived; ``quorum = P - b`` is synchronous SGD with
        b backup workers), ``deadline`` (starts once ``quorum`` ranks have arrived, default
        all P, or an adaptive deadline after the first arrival, whichever is first: the
        median plus ``mad_factor`` (default 3) median absolute deviations of the arrival
        spreads of the last ``deadline_window`` (default 16) executions, within
        ``deadline=(lo, hi)`` seconds (default ``(0.001, 1.0)``; one number: a fixed
        deadline); ``PartialResult.deadline`` and ``.deadline_expired`` say what happened;
        docs/partial.md). ``like``: an array of the shape and dtype of every call's data.
        ``accumulate``: ``True`` (or ``"sum"``): a call returns the sum of every result
        completed since the previous call instead of the latest; ``"mean"``: the sum of each
        of those results divided by its own ``count`` (the per-execution average, what
        averaging by contributions needs: dividing summed results by summed counts would weigh
        executions by their size; dense floating-point data and ``op="sum"`` only);
        ``"world"``: the sum of each of those results divided by the size of the world it
        spanned (P, or the survivors' number after a lost rank: ``survive``), as it completes:
        synchronous SGD's average over every gradient, still right when a loss changes the
        world between a result's completion and the call that takes it (dense floating-point
        data and ``op="sum"`` only).
        ``op="avg"``: **averaging by contributions**: each execution's sum is divided by its
        own ``count`` (the local contributions summed into it, over all ranks; an empty
        execution stays zeros), not by P; with ``accumulate`` the value is the sum of those
        per-execution averages (``"mean"``). Floating-point data only.
        **Tensors**: ``like`` and every call's ``x`` may be torch tensors (CPU or CUDA, see
        :mod:`asynccoll.comm.tensors`); a call returns its value as the type of its ``x``,
        ``flush`` as the type of ``like``.
        ``seed``: the initiator draws' seed (default: from the name). ``name``: identifies
        the handle across ranks (default: the order of creation). ``timeout``: default per
        call.

        **Sparse contributions**: with ``like`` a :class:`~asynccoll.SparseVector`, calls take
        SparseVectors (or dense arrays) of its size and dtype, stale data accumulates sparse
        until it passes ``delta``, and each result's ``value`` is a SparseVector or a dense
        1-D array as the sum's density dictates (docs/partial.md). ``op`` must be ``sum``;
        ``algorithm`` names a sparse algorithm, or is chosen from ``density`` (the expected
        per-rank fraction of nonzeros, the same on every rank) and P. ``density`` and
        ``delta`` apply to sparse handles only.

        ``survive``: whether the handle goes on without a lost rank (default:
        :attr:`survive`): the survivors agree on who is lost, settle the execution under way
        and rebuild the schedule for themselves, and ``PartialResult.lost`` names the ranks
        lost (:mod:`asynccoll.comm.survival`, docs/groups.md). Dense and sparse handles; one
        made while a rank is being lost goes on without it like the others.

        ``shm``: whether the data phase goes through shared memory (:mod:`asynccoll.comm.shm`;
        the activation rides on its wake-ups). ``None``: when every rank is on this host,
        ``like`` is a NumPy array of at least 128 KiB and ``algorithm`` is None (unless
        ``ASYNCCOLL_SHM=0``); ``True`` (or ``algorithm="shm"``, ``"shm_one_shot"``,
        ``"shm_two_shot"``): always, ``ValueError`` if the ranks are on several hosts;
        ``False``: never. Creating the handle stays free of collectives: this rank's segments
        are made at once, its peers' mapped at the first execution (docs/collectives.md).
        A handle that survives a lost rank goes on over the network. For sparse handles
        (``like`` a SparseVector): with the split algorithms only (``ssar_split_allgather``,
        ``dsar_split_allgather``; ``shm=True`` without ``algorithm`` takes the first), their
        sparse allreduce through shared memory; ``None`` takes it when every rank is on this
        host, the algorithm (chosen or given) is a split one and ``/dev/shm`` could hold every
        rank's segment twice over, at any size; the activation keeps its broadcast
        (docs/sparse.md).

        Raises ``ValueError`` naming ``kind``, ``quorum``, ``op``, ``algorithm``, ``name`` (in
        use), ``like``, ``deadline``, ``mad_factor``, ``deadline_window`` or ``shm``;
        ``OSError`` when this rank's shared-memory segments cannot be created. Builds and arms
        the schedule at once (so other ranks' activations are answered from now on); costs
        O(P log P) Python work.
        """
        survives = self.survive if survive is None else bool(survive)
        if self._closed or not survives:  # (a surviving handle made after a loss recovers)
            self._check_open()
        like, like_kind = from_tensor(like, "like")
        sparse = isinstance(like, SparseVector)
        if not sparse:
            check_array(like, "like")
            if density is not None or delta is not None:
                raise ValueError("density and delta apply to sparse handles only (like must "
                                 "be a SparseVector)")
        check_kind(kind, self.size, quorum)
        check_deadline(kind, deadline, mad_factor, deadline_window)
        if accumulate not in (False, True, "sum", "mean", "world"):
            raise ValueError(f"accumulate must be False, True, 'sum', 'mean' or 'world', got "
                             f"{accumulate!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}")
        if algorithm == "hier":
            return self._hier_partial(kind, like, like_kind, op, accumulate, quorum, seed, name,
                                      timeout, deadline, mad_factor, deadline_window, survive,
                                      shm)
        average = op == "avg"
        if average:
            _avg_op(op, like)
            if accumulate == "world":
                raise ValueError("accumulate='world' divides by the world size; op='avg' "
                                 "divides by contributions: give one of them")
            op = "sum"
            accumulate = "mean" if accumulate else False
        check_op(op)
        if accumulate in ("mean", "world") and (
                sparse or op != "sum" or not np.issubdtype(np.dtype(like.dtype), np.floating)):
            raise ValueError(f"accumulate={accumulate!r} needs dense floating-point data and "
                             f"op='sum' (got like={type(like).__name__}, op={op!r})")
        token: int | None = None
        # before the name is taken: a refusal must not shift the automatic names
        if sparse:
            sdt = np.dtype(like.values.dtype)
            chosen = choose_algorithm(density, self.size, like.size, sdt, delta)  # checks it
            algorithm, token = self._dense.router.sparse_partial(
                self._dense.layout, algorithm or chosen, algorithm, shm)
        else:
            token, algorithm = self._dense.router.dense_partial(self._dense.layout, like,
                                                                algorithm, shm)
        name = self._partial_name(name)
        s = stable_id(name, 2) if seed is None else int(seed)
        t = self.timeout if timeout is None else timeout
        contribution: Contribution = (
            SparseContribution(op, algorithm, density=density, delta=delta,
                               shm=token is not None) if sparse
            else DenseContribution(op, algorithm))
        h = self._engine.call(lambda: TensorPartialAllreduce(
            self._engine, self.transport, contribution, kind=kind, like=like,
            accumulate="sum" if accumulate is True else accumulate, quorum=quorum, seed=s,
            name=name, timeout=t,
            trace=self._writer, kernels=self.kernels, live=self.live,
            stall_warn=self.stall_warn, average=average and not accumulate,
            deadline=deadline, mad_factor=mad_factor, deadline_window=deadline_window,
            like_kind=like_kind, shm_token=token))
        h.clock_offset = self.clock_offset
        if survives:
            h.follow(Survival(h, self))
        self._handles[name] = h
        return h

    def _partial_name(self, name: str | None) -> str:
        """``name`` checked (or the next automatic one) for a new partial handle, flat or
        hierarchical; ``ValueError`` when one of this communicator's has it already."""
        name = self._handle_name(name, "partial")
        if name in self._handles or name in self._hier_handles:
            raise ValueError(f"name {name!r} is already used by a partial allreduce of this "
                             "communicator")
        return name

    def _hier_partial(self, kind: str, like: Any, like_kind: Any, op: str,
                      accumulate: bool | str, quorum: int | None, seed: int | None,
                      name: str | None, timeout: float | None, deadline: Any,
                      mad_factor: float | None, deadline_window: int | None,
                      survive: bool | None, shm: bool | None) -> HierPartialAllreduce:
        """``partial_allreduce(..., algorithm="hier")``: :mod:`.hier_partial`, each option it
        does not offer refused by name."""
        if isinstance(like, SparseVector) or like_kind is not None:
            raise TypeError("algorithm='hier' takes NumPy arrays (like), got "
                            f"{type(like).__name__}")
        if op == "avg" or accumulate in ("mean", "world"):
            raise ValueError(f"algorithm='hier': op={op!r}, accumulate={accumulate!r}: "
                             "averaging divisors would count host sums, not ranks (use "
                             "op='sum' and divide)")
        check_op(op)
        if self.hosts:  # known (connect() learns them): quorum counts hosts
            check_kind(kind, len(self.hosts), quorum)
        if survive:
            raise ValueError("algorithm='hier' cannot survive a lost rank (survive=True)")
        if shm is not None:
            raise ValueError("algorithm='hier' takes shared memory within each host itself "
                             f"(shm must be None, got {shm!r})")
        name = self._partial_name(name)
        options: dict[str, Any] = {
            "op": op, "accumulate": accumulate, "quorum": quorum, "seed": seed,
            "timeout": timeout, "deadline": deadline, "mad_factor": mad_factor,
            "deadline_window": deadline_window, "survive": False}
        h = HierPartialAllreduce(self, kind, like, name, options)
        self._hier_handles[name] = h
        return h

    def _shortcut(self, kind: str, x: Any, quorum: int | None = None) -> PartialAllreduce:
        if isinstance(x, SparseVector):
            key: tuple[Any, ...] = (kind, "sparse", x.size, x.values.dtype.str, quorum)
        else:
            check_array(x, "x")
            key = (kind, tuple(x.shape), np.dtype(x.dtype).str, quorum)
        h = self._shortcuts.get(key)
        if h is None:
            h = self.partial_allreduce(kind, x, quorum=quorum)
            self._shortcuts[key] = h
        return h

    async def _shortcut_call(self, kind: str, x: Any, timeout: float | None,
                             quorum: int | None = None) -> PartialResult:
        a, tkind = from_tensor(x, "x")
        return wrap_result(await self._shortcut(kind, a, quorum)(a, timeout), tkind)

    def _shortcut_blocking(self, kind: str, x: Any, timeout: float | None,
                           quorum: int | None = None) -> PartialResult:
        # the handle's own blocking call: a call that rule 1 answers stays on this thread
        a, tkind = from_tensor(x, "x")
        return wrap_result(self._shortcut(kind, a, quorum).blocking(a, timeout), tkind)

    async def solo_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``partial_allreduce("solo", like=x)(x)`` with the handle cached per shape/dtype."""
        return await self._shortcut_call("solo", x, timeout)

    async def majority_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``partial_allreduce("majority", like=x)(x)``, cached per shape/dtype."""
        return await self._shortcut_call("majority", x, timeout)

    async def two_choice_allreduce(self, x: Any,
                                   timeout: float | None = None) -> PartialResult:
        """``partial_allreduce("two_choice", like=x)(x)``, cached per shape/dtype."""
        return await self._shortcut_call("two_choice", x, timeout)

    async def quorum_allreduce(self, x: Any, k: int,
                               timeout: float | None = None) -> PartialResult:
        """``partial_allreduce("quorum", like=x, quorum=k)(x)``, cached per shape/dtype/k."""
        return await self._shortcut_call("quorum", x, timeout, k)


def _members_hash(members: list[int]) -> int:
    """A non-negative int64 hash of a list of ranks (equal lists, equal hashes)."""
    d = hashlib.blake2b(np.asarray(members, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1


def _check_x(x: Any) -> None:
    check_array(x, "x")


def _avg_op(op: Any, x: Any) -> tuple[Any, bool]:
    """``("sum", True)`` for ``op="avg"`` on floating-point ``x`` (``ValueError`` naming
    ``op`` for other data), else ``(op, False)``."""
    if op != "avg":
        return op, False
    dt = x.values.dtype if isinstance(x, SparseVector) else x.dtype
    if np.dtype(dt).kind not in "fc":
        raise ValueError(f"op='avg' needs floating-point data, got dtype {dt}")
    return "sum", True


def _as_kind(a: Any, kind: TensorKind | None) -> Any:
    return a if kind is None else kind.wrap(a)


def _flat_copy(x: Any) -> Any:
    return x.reshape(-1).copy()


def _empty_like(x: Any, shape: tuple[int, ...]) -> Any:
    import cupy

    return cupy.empty(shape, x.dtype)

