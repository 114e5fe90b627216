"""The synchronous collectives of one communicator: each distinct definition's schedule built,
committed and agreed on once, then reused (DESIGN §6).

A definition (``(collective, count, dtype, op, algorithm[, root])``) gets its schedule id from
the order in which it first appears, as MPI's ordering rule wants; at that first use every rank
compares a hash of the definition (one 16-byte allreduce), so ranks that disagree on ``op`` or
``root`` get an ExecutionError instead of silently different results. Later calls cost one
execution of the cached executor and nothing else.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import dense
from ..collectives.agreement import disagreement
from ..collectives.dense import scratch_buffers
from ..collectives.shm import (
    SHM_NAMES,
    shm_algorithm,
)
from ..errors import ExecutionError, PeerLostError
from ..sched import Executor, KernelRegistry, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
from . import route
from .route import Layout, Router
from .shm import host_hash, new_token
from .shm_ops import AGREE_KEY, Cached, ShmAllreduce, ShmUnavailable, _Arena, _Shm
from .stall import wait_or_warn

__all__ = ["DenseOps", "ShmUnavailable"]

log = logging.getLogger("asynccoll.comm")

#: below this many bytes a cached collective copies through its own buffer instead of
#: rebinding the executor to the caller's array (rebinding costs O(ops) Python work).
_SMALL = 64 << 10


class DenseOps(ShmAllreduce):
    """The cached synchronous collectives of one rank, on the transport's loop.

    ``next_id``: the communicator's schedule-id counter. ``stall_warn``: seconds before a
    waiting call warns (see :mod:`.stall`). ``writer``: the trace writer, or None.
    """

    def __init__(self, transport: Transport, next_id: Callable[[], int], *,
                 kernels: KernelRegistry, live: LiveOps, writer: TraceWriter | None,
                 stall_warn: float | None, router: Router) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.world_size
        self._next_id = next_id
        self._kernels = kernels
        self._live = live
        self._writer = writer
        self._stall_warn = stall_warn
        self.entries: dict[tuple[Any, ...], Cached] = {}
        self._internal: dict[tuple[Any, ...], Cached] = {}  # the runtime's own collectives
        self._shm: dict[tuple[Any, ...], _Shm] = {}
        self._cma: dict[tuple[Any, ...], Cached] = {}  # the single-copy allreduces (.cma)
        #: every rank's process id when every rank may read every other one's memory
        #: (:meth:`_cma_probe`, at the first large allreduce on one host); [] when not
        self._cma_pids: list[int] | None = None
        self._cma_held: list[Any] = []  # arrays of failed single-copy calls, kept until close
        self._order: dict[tuple[Any, ...], asyncio.Lock] = {}  # allreduce's call order
        self._shm_locks: dict[tuple[Any, ...], asyncio.Lock] = {}  # one setup per shm key
        #: schedule ids taken for the runtime's own collectives before their first use
        #: (:meth:`_reserve`)
        self._reserved: dict[tuple[Any, ...], int] = {}
        self._host_lock = asyncio.Lock()  # one learning of the hosts, however many callers
        self._arenas: dict[int, _Arena] = {}  # by address: arrays made by shared_empty
        #: where the ranks are (:class:`~.route.Layout`), after the first :meth:`hosts`
        self.layout: Layout | None = None
        #: the first lost rank this rank learned of, or None (set by the communicator): an
        #: execution a call starts after it raises at once (:meth:`_execute`)
        self.lost: Callable[[], PeerLostError | None] = lambda: None
        #: the one place that chooses a data path (:mod:`.route`)
        self.router = router

    def close(self) -> None:
        """Close every cached executor (waiting calls fail with TransportClosedError)."""
        for cache in (self.entries, self._internal):
            for d in cache.values():
                d.ex.close()
            cache.clear()
        for sh in self._shm.values():
            sh.close(self._live)
        self._shm.clear()
        for d in self._cma.values():
            d.ex.close()
            self._live.discard(d.ex)
        self._cma.clear()
        self._cma_held.clear()
        for arena in self._arenas.values():
            arena.close(self._live)
        self._arenas.clear()


    # -- allreduce: over the network, or through shared memory on one host -------------------
    async def allreduce(self, buf: Any, op: str, algorithm: str | None,
                        timeout: float | None) -> None:
        """Allreduce ``buf`` (flat, contiguous) in place: through shared memory when
        ``algorithm`` is one of :data:`SHM_NAMES` (``"shm"``: one-shot or two-shot by size),
        or by default from :data:`~.shm.SHM_MIN_BYTES` up when every rank is on this host
        (the same choice on every rank: same size, same hosts) unless ``ASYNCCOLL_SHM=0``;
        else the network schedule of ``algorithm`` (:mod:`asynccoll.collectives.dense`).

        Calls with the same size, dtype, op and algorithm run in the order they were made,
        one at a time (a FIFO lock taken before the first await): a call made while an
        earlier one is still setting up (agreeing on its definition, learning the hosts,
        mapping segments) queues behind it instead of overtaking it, which would pair its
        execution with the peers' earlier call or set the collective up twice."""
        okey = (buf.size, buf.dtype.str, op, algorithm)
        lock = self._order.get(okey)
        if lock is None:
            lock = self._order[okey] = asyncio.Lock()
        async with lock:
            await self._allreduce(buf, op, algorithm, timeout)

    async def _allreduce(self, buf: Any, op: str, algorithm: str | None,
                         timeout: float | None) -> None:
        arena = self._arenas.get(buf.__array_interface__["data"][0]) \
            if isinstance(buf, np.ndarray) and (algorithm is None or algorithm in SHM_NAMES) \
            else None
        if arena is not None and arena.count == buf.size and arena.dtype == buf.dtype:
            # Reduced where it lies, each rank's block pushed into every peer's array: faster
            # than the single-copy path at every size measured (no system calls, no page
            # pinning; docs/benchmarks.md), so that path is not asked here
            await self._arena_allreduce(arena, buf, op, shm_algorithm(algorithm), timeout)
            return
        numpy = isinstance(buf, np.ndarray)
        layout = None
        if self.router.needs_layout(buf.nbytes, numpy, algorithm) and self.size > 1:
            await self._hosts(timeout)
            layout = self.layout
        path = self.router.allreduce(layout, buf.nbytes, numpy, algorithm)
        if path != route.NETWORK and await self._shm_or_not(buf, op, algorithm, timeout,
                                                             hier=path == route.HIER):
            return
        key = ("allreduce", buf.size, buf.dtype.str, op, algorithm)
        await self.call(key, lambda: dense.allreduce(self.rank, self.size, buf.size, buf.dtype,
                                                      op, algorithm), buf, timeout)


    async def _hosts(self, timeout: float | None) -> tuple[bool, int]:
        """(whether every rank is on this host, the job's segment token): one allgather of
        each rank's host hash and a token, at first use."""
        if self.layout is None:
            async with self._host_lock:
                if self.layout is None:
                    await self._learn_hosts(timeout)
        assert self.layout is not None
        return self.layout.one_host, self.layout.token

    async def _learn_hosts(self, timeout: float | None) -> None:
        mine = np.array([host_hash(), new_token()], np.int64)
        every = np.zeros(2 * self.size, np.int64)
        every[2 * self.rank:2 * self.rank + 2] = mine
        # fixed by the runtime (nothing the ranks could disagree on): not agreed, so that
        # connect() learning it leaves the agreement's executions to the user's calls
        await self.call(("hosts",), lambda: dense.allgather(self.rank, self.size, 2, np.int64),
                        every, timeout, agree=False)
        self.layout = Layout(tuple(every[0::2].tolist()), int(every[1]))

    async def hosts(self, timeout: float | None) -> tuple[bool, int]:
        """(whether every rank is on this host, the job's segment token): collective at the
        first call (one allgather of two int64 per rank), free afterwards."""
        return await self._hosts(timeout)

    def inherit_hosts(self, parent: DenseOps, members: list[int], key: str) -> None:
        """Know the host layout of the group ``key`` made of the ``members`` (ranks of
        ``parent``) without a collective, when ``parent`` knows its own
        (:meth:`Layout.of_group <.route.Layout.of_group>`)."""
        if parent.layout is not None:
            self.layout = parent.layout.of_group(members, key)


    def _lock(self, key: tuple[Any, ...]) -> asyncio.Lock:
        """The setup lock of ``key`` (made at its first use)."""
        lock = self._shm_locks.get(key)
        if lock is None:
            lock = self._shm_locks[key] = asyncio.Lock()
        return lock


    def raise_if_lost(self) -> None:
        """PeerLostError naming the lost rank once one is known. A loss fails the executions
        under way when it is learned, but a call of several steps (the segments' setup: a
        barrier, the mapping, a flag allreduce) may start one after that, and then waited,
        seen, for a survivor that had given up already, until its timeout."""
        err = self.lost()
        if err is not None:
            raise PeerLostError(err.rank, err.reason)

    async def _execute(self, ex: Executor, timeout: float | None, what: str) -> None:
        """Run one execution of ``ex`` and wait for it, warning while it stalls; a timeout
        raises the executor's CollectiveTimeoutError (naming what is awaited). A rank lost
        before it starts fails it at once (:meth:`raise_if_lost`)."""
        self.raise_if_lost()
        try:
            await wait_or_warn(ex.start(), timeout, self._stall_warn,
                               lambda: f"rank {self.rank}: {what}", ex.pending_text)
        except asyncio.TimeoutError:
            raise ex.timeout_error(timeout) from None

    def _reserve(self, *keys: tuple[Any, ...]) -> None:
        """Take now the schedule ids of the runtime's own collectives ``keys`` that have none
        yet (the agreement, the barrier and the flag of a shared-memory setup). A setup takes
        every id it needs before its first await, in a fixed order, so that another call made
        meanwhile (a small allreduce beside a large one's first use) takes its id after them
        on every rank; taken at their first use instead, mid-setup, they fell on one side of
        that call on one rank and on the other side on another (timeouts, false
        disagreements)."""
        for key in keys:
            cache = self._internal if key == AGREE_KEY else self.entries
            if key not in cache and key not in self._reserved:
                self._reserved[key] = self._next_id()

    async def call(self, key: tuple[Any, ...], build: Callable[[], Schedule], data: Any,
                   timeout: float | None, *, agree: bool = True) -> None:
        """Run the collective of ``key`` (its schedule from ``build()`` at first use) on
        ``data`` in place, waiting at most ``timeout`` seconds (CollectiveTimeoutError).
        ``agree=False``: skip the check of the definition at first use (the runtime's own
        collectives of a fixed definition)."""
        cache = self._internal if key == AGREE_KEY else self.entries
        while True:
            entry = cache.get(key)
            fresh = entry is None
            if entry is None:
                entry = self._create(key, build, data, cache)
            # Calls of one key execute in the order they were made: the lock is FIFO and is
            # taken before the first use's agreement (an await), so a second call made
            # meanwhile queues behind the first instead of overtaking it and pairing with the
            # peers' first call (mixed sums; seen with OD-SGD's call in flight).
            async with entry.lock:
                if cache.get(key) is not entry:
                    continue  # dropped by the call before this one: start a fresh executor
                if fresh and agree and key != AGREE_KEY and self.size > 1:
                    sched = entry.ex.schedule
                    what = sched.meta.get("collectives", [{"kind": key[0]}])[0]
                    try:
                        await self.agree_on(key[0], what, timeout)
                    except BaseException:
                        self._drop(key, entry, cache)
                        raise
                ex = entry.ex
                own = entry.own
                if own is not None:
                    own[...] = data
                elif data is not None and not fresh:
                    ex.bind({"data": data, **entry.scratch})  # O(ops): views of the new array
                try:
                    await self._execute(ex, timeout, str(key[0]))
                    if own is not None:
                        data[...] = own
                except BaseException as exc:
                    # A failed, timed-out or cancelled execution leaves the executor mid-way:
                    # drop it (its receives retired); the next call of this key, and any call
                    # queued behind this one, starts a fresh one.
                    if self._writer is not None:
                        self._writer.write_pending(ex, reason=repr(exc))
                    self._drop(key, entry, cache)
                    raise
                return

    def _create(self, key: tuple[Any, ...], build: Callable[[], Schedule], data: Any,
                cache: dict[tuple[Any, ...], Cached]) -> Cached:
        """The cache entry of ``key``: its schedule from ``build()``, an id, an executor."""
        sched = build()  # before taking an id: a bad argument must not shift the ids
        sid = self._reserved.pop(key, None)
        if sid is None:
            sid = self._next_id()
        scratch = scratch_buffers(sched, None if data is None or isinstance(data, np.ndarray)
                                  else data)
        bufs = dict(scratch)
        own = None
        if "data" in sched.slots:
            small = isinstance(data, np.ndarray) and data.nbytes <= _SMALL
            own = data.copy() if small else None
            bufs["data"] = data if own is None else own
        sink = None if self._writer is None else self._writer.add_schedule(
            sched, sid, collective=key[0])
        ex = self._live.add(Executor(sched, self.transport, bufs, sched_id=sid,
                                     trace_sink=sink, kernels=self._kernels), self._writer)
        entry = Cached(ex, scratch, own)
        cache[key] = entry
        return entry

    async def agree_on(self, kind: str, what: dict[str, Any], timeout: float | None) -> None:
        """Raise ExecutionError on every rank, naming the ranks that differ, unless every rank
        passes the same ``what`` (the definition of a collective at its first use); one
        allgather of an 8-byte hash per rank."""
        digest = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8)
        every = np.zeros(self.size, np.int64)
        every[self.rank] = int.from_bytes(digest.digest(), "little") >> 1
        await self.call(AGREE_KEY, lambda: dense.allgather(
            self.rank, self.size, 1, every.dtype), every, timeout)
        if (every != every[self.rank]).any():
            raise ExecutionError(disagreement(self.rank, kind, every.tolist(), what))

    def _drop(self, key: tuple[Any, ...], entry: Cached,
              cache: dict[tuple[Any, ...], Cached]) -> None:
        entry.ex.close()
        self._live.discard(entry.ex)
        if cache.get(key) is entry:
            del cache[key]
