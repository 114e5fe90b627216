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
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import dense
from ..collectives.agreement import disagreement
from ..collectives.dense import REDUCE_OPS, scratch_buffers
from ..collectives.shm import (
    SHM_ALGORITHMS,
    SHM_INPLACE_OWN_KERNELS,
    SHM_NAMES,
    build_hier_allreduce,
    build_shm_allreduce,
    build_shm_inplace,
    choose_shm,
    shm_algorithm,
)
from ..errors import ExecutionError, PeerLostError
from ..sched import Executor, KernelRegistry, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
from . import route
from .cma import (
    CMA_OWN_KERNELS,
    build_cma_allreduce,
    cma_enabled,
    cma_size,
    hold,
    read_remote,
    write_remote,
)
from .route import Layout, Router
from .shm import Segment, host_hash, new_token, segment_path
from .stall import wait_or_warn

__all__ = ["DenseOps", "ShmUnavailable"]

log = logging.getLogger("asynccoll.comm")

#: the cache key of the collective that checks the others' definitions
_AGREE_KEY: tuple[Any, ...] = ("agree",)

#: below this many bytes a cached collective copies through its own buffer instead of
#: rebinding the executor to the caller's array (rebinding costs O(ops) Python work).
_SMALL = 64 << 10


class ShmUnavailable(ExecutionError):
    """Shared-memory segments could not be created or mapped on some rank (every rank raises
    it together); the message says why on the rank where it happened."""


class _Arena:
    """An array allocated in shared memory (one segment per rank) and its in-place
    allreduce executors, one per op and algorithm (made at first use)."""

    def __init__(self, sids: dict[tuple[str, str], int], segs: list[Any], arrays: list[Any],
                 count: int, dtype: np.dtype[Any]) -> None:
        self.segs = segs
        self.arrays = arrays
        self.count = count
        self.dtype = dtype
        self.executors: dict[tuple[str, str], Executor] = {}
        self.sids = sids
        self.lock = asyncio.Lock()

    def close(self, live: LiveOps) -> None:
        for ex in self.executors.values():
            ex.close()
            live.discard(ex)
        self.executors.clear()
        self.arrays = []
        for seg in self.segs:
            seg.close()


def _shm_setup_keys(key: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...]:
    """The reservation keys of every schedule id the segment setup of shared-memory key
    ``key`` takes: the agreement, its barrier and flag, then its two executors."""
    return (_AGREE_KEY, ("barrier",), ("shm_ok",), ("shm", 0, *key), ("shm", 1, *key))


class _Shm:
    """A shared-memory allreduce: two executors and their segments, used in turn (one call
    at a time)."""

    def __init__(self, sides: list[tuple[Executor, dict[str, Any], list[Any]]]) -> None:
        self.sides = sides
        self.calls = 0
        self.lock = asyncio.Lock()

    def next(self) -> tuple[Executor, dict[str, Any]]:
        ex, arrays, _ = self.sides[self.calls % 2]
        self.calls += 1
        return ex, arrays

    def close(self, live: LiveOps) -> None:
        for ex, arrays, segs in self.sides:
            ex.close()
            live.discard(ex)
            arrays.clear()
            for seg in segs:
                seg.close()
        self.sides = []


class _Dense:
    """A cached synchronous collective: its executor, scratch buffers and a lock (one at a time)."""

    def __init__(self, ex: Executor, scratch: dict[str, Any], own: Any) -> None:
        self.ex = ex
        self.scratch = scratch
        self.own = own  # the bound "data" buffer when small (else None: rebind per call)
        self.lock = asyncio.Lock()


class DenseOps:
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
        self.entries: dict[tuple[Any, ...], _Dense] = {}
        self._internal: dict[tuple[Any, ...], _Dense] = {}  # the runtime's own collectives
        self._shm: dict[tuple[Any, ...], _Shm] = {}
        self._cma: dict[tuple[Any, ...], _Dense] = {}  # the single-copy allreduces (.cma)
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

    async def shared_empty(self, shape: tuple[int, ...], dtype: Any,
                           timeout: float | None) -> Any:
        """A new array of ``shape`` and ``dtype`` in a shared-memory segment that every rank
        of this host maps (collective: every rank calls it with the same arguments, in the
        same order). An allreduce of it with ``out=`` itself reads it in place."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count < 1:
            raise ValueError(f"shape must hold at least one element, got {shape}")
        if dt.hasobject:
            raise TypeError(f"dtype must be a plain numeric dtype, got {dt}")
        same, token = await self._hosts(timeout)
        if not same:
            raise ValueError("shared arrays need every rank on one host (ASYNCCOLL_HOST_ID "
                             "or the host name and boot id differ)")
        self._reserve(_AGREE_KEY, ("barrier",), ("shm_ok",))
        sid = self._next_id()
        # the in-place allreduce's schedule ids, one per op and algorithm, taken now in a
        # fixed order
        sids = {(op, a): self._next_id() for op in sorted(REDUCE_OPS) for a in SHM_ALGORITHMS}
        # peers' arrays mapped writable: each rank writes its reduced block into every one
        segs = await self._map_segments([sid], count * dt.itemsize, token, timeout,
                                        writable=True)
        arrays = [seg.array(dt, count) for seg in segs[0]]
        mine = arrays[self.rank]  # writable: this rank's own segment
        arena = _Arena(sids, segs[0], arrays, count, dt)
        self._arenas[mine.__array_interface__["data"][0]] = arena
        return mine.reshape(shape)

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

    async def _shm_or_not(self, buf: Any, op: str, algorithm: str | None,
                          timeout: float | None, hier: bool) -> bool:
        """Run the shared-memory allreduce; when it was the default's choice and the segments
        cannot be had (every rank learns it together), log it once, stop choosing it and
        return False so that the caller takes the network path. Asked for by name, raise."""
        try:
            await self._shm_allreduce(buf, op, timeout, hier, shm_algorithm(algorithm))
            return True
        except ShmUnavailable as exc:
            if algorithm is not None:
                raise
            self.router.refuse_shm()
            log.warning("%s; the allreduce goes over the network from now on", exc)
            return False

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

    async def _shm_allreduce(self, buf: Any, op: str, timeout: float | None,
                             hier: bool = False, algorithm: str | None = None) -> None:
        name = "hier" if hier else "shm"
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"algorithm={name!r} needs a NumPy array (shared memory is host "
                            "memory)")
        same, token = await self._hosts(timeout)
        if not same and not hier:
            raise ValueError("algorithm='shm' needs every rank on one host (ASYNCCOLL_HOST_ID "
                             "or the host name and boot id differ)")
        algo = None if hier else choose_shm(buf.nbytes, self.size, algorithm)
        key = (buf.size, buf.dtype.str, op, algo, hier)
        if key not in self._shm:
            # Every id a segment setup of this key takes, now, before the single-copy path's
            # probe (an await): taken after it, they came after another call's on a rank
            # where that call started meanwhile and before it on another (ids out of step,
            # the setup's barrier timed out).
            self._reserve(*_shm_setup_keys(key))
        if not hier and self._cma_sized(buf.nbytes, algorithm) \
                and await self._cma_allreduce(buf, op, timeout):
            return
        sh = self._shm.get(key)
        if sh is None:
            # Calls that reach one shared-memory key by different ``algorithm`` names (None
            # and "shm") hold different call-order locks: one setup, the others queue on it.
            async with self._lock(key):
                sh = self._shm.get(key)
                if sh is None:
                    sh = await self._shm_setup(key, buf, op, token, timeout, hier, algo)
        async with sh.lock:
            ex, segs = sh.next()
            ex.bind({"data": buf, **segs})
            try:
                await self._execute(ex, timeout, "allreduce (shared memory)")
            except BaseException:  # mid-way: its segments cannot be trusted any more
                sh.close(self._live)
                self._shm.pop(key, None)
                raise

    def _cma_sized(self, nbytes: int, algorithm: str | None) -> bool:
        """Whether an allreduce of ``nbytes`` through shared memory (``algorithm``: the
        forced shared-memory algorithm, or None) asks the single-copy path first: two-shot by
        size, not forced, blocks large enough (:func:`~.cma.cma_size`). Asked even once the
        probe said no (it then answers False at once): whether a rank knows the probe's
        answer yet depends on timing, and the ids it takes must not (:meth:`_cma_allreduce`)."""
        return (algorithm is None and choose_shm(nbytes, self.size) == "two_shot"
                and cma_size(nbytes, self.size))

    def _lock(self, key: tuple[Any, ...]) -> asyncio.Lock:
        """The setup lock of ``key`` (made at its first use)."""
        lock = self._shm_locks.get(key)
        if lock is None:
            lock = self._shm_locks[key] = asyncio.Lock()
        return lock

    async def _cma_allreduce(self, buf: Any, op: str, timeout: float | None) -> bool:
        """Allreduce ``buf`` with the single-copy schedule of :mod:`.cma`; False (on every
        rank alike) when some rank may not read its peers' memory or has it turned off
        (``ASYNCCOLL_CMA=0``), after which the two-shot over segments serves every call."""
        key = (buf.size, buf.dtype.str, op)
        entry = self._cma.get(key)
        if entry is None:
            # Every id this setup may need is taken now, before the first await, whatever the
            # probe will say or has said: a rank whose call comes while the probe still runs
            # and one whose call comes after it must take the same ids in the same order (an
            # id taken only by the first, or the agreement's taken after another call's setup
            # on one rank and before it on another, left the ranks' ids out of step: every
            # later setup timed out). Once the probe said no, the key's id stays reserved,
            # unused, alike on every rank. (The segments' fallback reserved its ids before
            # this, in _shm_allreduce.)
            self._reserve(("cma", *key), _AGREE_KEY, ("cma_probe",), ("shm_ok",))
            async with self._lock(("cma", *key)):
                entry = self._cma.get(key)
                if entry is None:
                    if self._cma_pids is None:
                        # One probe, however many calls of other sizes wait for it: a call
                        # that came while it ran on one rank only (its peers called after it
                        # was done) probed a second time there, alone, and hung.
                        async with self._lock(("cma_probe",)):
                            if self._cma_pids is None:
                                self._cma_pids = await self._cma_probe(timeout)
                    if not self._cma_pids:
                        return False
                    # (none left when a setup of this key before it failed after taking it)
                    sid = self._reserved.pop(("cma", *key), None) or self._next_id()
                    sched = build_cma_allreduce(self.rank, self.size, buf.size, buf.dtype, op,
                                                self._cma_pids)
                    await self.agree_on("allreduce", sched.meta["collectives"][0], timeout)
                    scratch = scratch_buffers(sched)
                    sink = None if self._writer is None else self._writer.add_schedule(
                        sched, sid, collective="allreduce")
                    ex = self._live.add(Executor(
                        sched, self.transport, {"data": buf, **scratch}, sched_id=sid,
                        trace_sink=sink,
                        kernels=self._kernels.extended(CMA_OWN_KERNELS, replace=True)),
                        self._writer)
                    entry = self._cma[key] = _Dense(ex, scratch, None)
        async with entry.lock:
            entry.ex.bind({"data": buf, **entry.scratch})
            try:
                await self._execute(entry.ex, timeout, "allreduce (cross-memory attach)")
            except BaseException:  # mid-way: start afresh at the next call
                # Peers may still read this array, or write their blocks into it, until they
                # notice: keep it alive (beyond close: hold) so that no late access lands in
                # memory reused for something else (its contents are undefined, as after any
                # failed in-place collective).
                self._cma_held.append(buf)
                hold(buf)  # and after close: a peer's reduce under way still writes into it
                entry.ex.close()
                self._live.discard(entry.ex)
                self._cma.pop(key, None)
                raise
        return True

    async def _cma_probe(self, timeout: float | None) -> list[int]:
        """Every rank's process id when every rank has the single-copy path on and could read
        a marker out of every peer's memory and write it back, else [] (one allgather and one
        flag, the same answer on every rank). The marker is random, so a process id that
        names another process here (another pid namespace) reads wrong and counts as
        refused."""
        marker = np.array([int.from_bytes(os.urandom(7), "little")], np.int64)
        every = np.zeros(4 * self.size, np.int64)
        every[4 * self.rank:4 * self.rank + 4] = [
            int(self.router.cma and cma_enabled()), os.getpid(), marker.ctypes.data, marker[0]]
        try:
            await self.call(("cma_probe",), lambda: dense.allgather(self.rank, self.size, 4,
                                                                      np.int64),
                            every, timeout, agree=False)
            rows = every.reshape(self.size, 4)
            ok = bool(rows[:, 0].all())
            cell = np.zeros(1, np.int64)
            for q in range(self.size):
                if not ok:
                    break
                if q == self.rank:
                    continue
                pid, where = int(rows[q, 1]), int(rows[q, 2])
                try:
                    read_remote(pid, where, cell.ctypes.data, 8)
                    ok = int(cell[0]) == int(rows[q, 3])
                    if ok:  # the same value back: the allreduce writes too
                        write_remote(pid, where, cell.ctypes.data, 8)
                except (OSError, RuntimeError):
                    ok = False
            flag = np.array([0 if ok else 1], np.int64)  # ``marker`` lives until all read it
            await self.call(("shm_ok",), lambda: dense.allreduce(
                self.rank, self.size, 1, np.int64, "max", "recursive_doubling"), flag, timeout,
                agree=False)
        except BaseException:
            # Given up (a timeout, a cancellation) once the peers may have this rank's row:
            # they still read ``marker`` and write it back. Kept alive, as a failed call's
            # array is, so that the write never lands in memory reused meanwhile.
            self._cma_held.append(marker)
            hold(marker)
            raise
        if flag[0]:
            log.info("single-copy allreduce (process_vm_readv/writev) unavailable between these "
                     "ranks; large allreduces copy through shared segments")
            return []
        return [int(p) for p in rows[:, 1]]

    async def _shm_setup(self, key: tuple[Any, ...], buf: Any, op: str, token: int,
                         timeout: float | None, hier: bool, algorithm: str | None) -> _Shm:
        """Two executors, each with a segment per rank: created, mapped by the ranks of its
        host, then unlinked (module doc of :mod:`.shm`). Collective; every rank fails if one
        cannot map."""
        if hier:
            assert self.layout is not None
            groups = self.layout.groups
            sched = build_hier_allreduce(self.rank, self.size, buf.size, buf.dtype, op,
                                         groups)
            local = next(g for g in groups if self.rank in g)
        else:
            sched = build_shm_allreduce(self.rank, self.size, buf.size, buf.dtype, op,
                                        algorithm)
            local = list(range(self.size))
        self._reserve(*_shm_setup_keys(key))  # before the first await (the caller has, too)
        sids = [self._reserved.pop(k) for k in _shm_setup_keys(key)[3:]]
        await self.agree_on("allreduce", sched.meta["collectives"][0], timeout)
        mapped = await self._map_segments(sids, buf.nbytes, token, timeout, local)
        sides = []
        for sid, segs in zip(sids, mapped, strict=True):
            arrays = {("mine" if q == self.rank else f"peer{q}"): seg.array(buf.dtype, buf.size)
                      for q, seg in zip(local, segs, strict=True)}
            arrays.update(scratch_buffers(sched))
            sink = None if self._writer is None else self._writer.add_schedule(
                sched, sid, collective="allreduce")
            ex = self._live.add(Executor(sched, self.transport, {"data": buf, **arrays},
                                         sched_id=sid, trace_sink=sink,
                                         kernels=self._kernels), self._writer)
            sides.append((ex, arrays, segs))
        sh = _Shm(sides)
        self._shm[key] = sh
        return sh

    def reserve_segment_setup(self) -> None:
        """Take now (before any await) the ids a later :meth:`map_segments` and :meth:`hosts`
        need: for the sparse allreduce's shared-memory setup (:mod:`.sparse`), as
        :meth:`_shm_allreduce` does for its own."""
        # ("hosts",) too: a key already made (learned at connect) or reserved is skipped
        self._reserve(("hosts",), _AGREE_KEY, ("barrier",), ("shm_ok",))

    async def map_segments(self, sids: list[int], nbytes: int, timeout: float | None
                           ) -> list[list[Segment]]:
        """Every rank's segment of ``nbytes`` per schedule id in ``sids`` (collective; every
        rank on this host): :meth:`_map_segments`. Raises :class:`ShmUnavailable` on every
        rank when one cannot create or map them."""
        _same, token = await self._hosts(timeout)
        return await self._map_segments(sids, nbytes, token, timeout)

    async def _map_segments(self, sids: list[int], nbytes: int, token: int,
                            timeout: float | None,
                            local: list[int] | None = None, writable: bool = False
                            ) -> list[list[Segment]]:
        """Per schedule id, the segments of ``nbytes`` of the ranks ``local`` (default: all),
        in their order: this rank's created here, the others mapped (read-only unless
        ``writable``), then every one unlinked by its owner (collective over all ranks). Every
        rank fails if one cannot map them."""
        members = list(range(self.size)) if local is None else local
        own: list[Segment] = []
        mapped: list[list[Segment]] = [[] for _ in sids]
        err: BaseException | None = None
        try:
            for sid in sids:
                own.append(Segment.create(segment_path(token, sid, self.rank), nbytes))
        except OSError as exc:  # told to the others below, so that every rank gives up
            err = exc
        try:
            # the runtime's own collectives of a fixed definition: not agreed (an agreement
            # here would interleave with those of calls made meanwhile differently per rank)
            await self.call(("barrier",), lambda: dense.barrier(self.rank, self.size), None,
                            timeout, agree=False)
            try:
                if err is None:
                    for i, sid in enumerate(sids):
                        mapped[i] = [own[i] if q == self.rank else
                                     Segment.attach(segment_path(token, sid, q), nbytes,
                                                    writable)
                                     for q in members]
            except (OSError, ValueError) as exc:
                err = exc
            flag = np.array([1 if err else 0], np.int64)
            await self.call(("shm_ok",), lambda: dense.allreduce(
                self.rank, self.size, 1, np.int64, "max", "recursive_doubling"), flag, timeout,
                agree=False)
        except PeerLostError as exc:
            # A rank lost during the setup cannot unlink the segments it created: its peers
            # know their names (same user, same job), so they do, and nothing is left.
            if 0 <= exc.rank < self.size and exc.rank != self.rank:
                for sid in sids:
                    with contextlib.suppress(OSError):
                        os.unlink(segment_path(token, sid, exc.rank))
            raise
        finally:
            for seg in own:
                seg.unlink()  # every rank has mapped it (or the setup failed): nothing left
        if err is not None or flag[0]:
            for segs in mapped:
                for seg in segs:
                    seg.close()
            for seg in own:
                seg.close()
            if err is not None:
                raise ShmUnavailable(f"rank {self.rank}: shared memory unavailable: {err}") \
                    from err
            raise ShmUnavailable(f"rank {self.rank}: another rank could not create or map "
                                 "this host's shared-memory segments (see its error)")
        return mapped

    async def _arena_allreduce(self, arena: _Arena, buf: Any, op: str, algorithm: str | None,
                               timeout: float | None) -> None:
        # two-shot unless one-shot is asked for: in place it pushes each reduced block into
        # every peer's array, two wake-up rounds as one-shot's but each rank reads its block of
        # each array once instead of every whole array (P = 4: 1.1-1.4x faster from 128 KiB,
        # 2x at 4 MiB; P = 8, 1 MiB: 1.6x; docs/benchmarks.md)
        algo = "two_shot" if algorithm is None else choose_shm(buf.nbytes, self.size, algorithm)
        ex = arena.executors.get((op, algo))
        if ex is None:
            sched = build_shm_inplace(self.rank, self.size, arena.count, arena.dtype, op, algo)
            await self.agree_on("allreduce", sched.meta["collectives"][0], timeout)
            bufs = {("mine" if q == self.rank else f"peer{q}"): a
                    for q, a in enumerate(arena.arrays)}
            bufs["mine"] = buf.reshape(-1)
            bufs.update(scratch_buffers(sched))
            sid = arena.sids[(op, algo)]
            sink = None if self._writer is None else self._writer.add_schedule(
                sched, sid, collective="allreduce")
            ex = self._live.add(Executor(
                sched, self.transport, bufs, sched_id=sid, trace_sink=sink,
                kernels=self._kernels.extended(SHM_INPLACE_OWN_KERNELS, replace=True)),
                self._writer)
            arena.executors[(op, algo)] = ex
        async with arena.lock:
            await self._execute(ex, timeout, "allreduce (shared array)")

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
            cache = self._internal if key == _AGREE_KEY else self.entries
            if key not in cache and key not in self._reserved:
                self._reserved[key] = self._next_id()

    async def call(self, key: tuple[Any, ...], build: Callable[[], Schedule], data: Any,
                   timeout: float | None, *, agree: bool = True) -> None:
        """Run the collective of ``key`` (its schedule from ``build()`` at first use) on
        ``data`` in place, waiting at most ``timeout`` seconds (CollectiveTimeoutError).
        ``agree=False``: skip the check of the definition at first use (the runtime's own
        collectives of a fixed definition)."""
        cache = self._internal if key == _AGREE_KEY else self.entries
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
                if fresh and agree and key != _AGREE_KEY and self.size > 1:
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
                cache: dict[tuple[Any, ...], _Dense]) -> _Dense:
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
        entry = _Dense(ex, scratch, own)
        cache[key] = entry
        return entry

    async def agree_on(self, kind: str, what: dict[str, Any], timeout: float | None) -> None:
        """Raise ExecutionError on every rank, naming the ranks that differ, unless every rank
        passes the same ``what`` (the definition of a collective at its first use); one
        allgather of an 8-byte hash per rank."""
        digest = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8)
        every = np.zeros(self.size, np.int64)
        every[self.rank] = int.from_bytes(digest.digest(), "little") >> 1
        await self.call(_AGREE_KEY, lambda: dense.allgather(
            self.rank, self.size, 1, every.dtype), every, timeout)
        if (every != every[self.rank]).any():
            raise ExecutionError(disagreement(self.rank, kind, every.tolist(), what))

    def _drop(self, key: tuple[Any, ...], entry: _Dense,
              cache: dict[tuple[Any, ...], _Dense]) -> None:
        entry.ex.close()
        self._live.discard(entry.ex)
        if cache.get(key) is entry:
            del cache[key]
