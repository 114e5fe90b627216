"""The synchronous allreduce within one host: through shared-memory segments (one-shot or
two-shot, :mod:`asynccoll.collectives.shm`), arrays that live in them (``comm.empty``), the
single-copy path between processes (:mod:`.cma`), and the hierarchical allreduce's host step.

Which of these a call takes is the route's to say (:mod:`.route`); here they are set up (the
segments made by every rank of the host, mapped by the others, unlinked once all have them;
a setup that fails on any rank fails on every rank alike, :class:`ShmUnavailable`, and the
default then goes over the network) and run. :class:`ShmAllreduce` is a part of
:class:`~.dense.DenseOps`, in a module of its own for size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import dense
from ..collectives.dense import REDUCE_OPS, scratch_buffers
from ..collectives.shm import (
    SHM_ALGORITHMS,
    SHM_INPLACE_OWN_KERNELS,
    build_hier_allreduce,
    build_shm_allreduce,
    build_shm_inplace,
    choose_shm,
    shm_algorithm,
)
from ..errors import ExecutionError, PeerLostError
from ..sched import Executor, KernelRegistry, LiveOps, Schedule, TraceWriter
from ..transport.base import Transport
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
from .shm import Segment, segment_path

__all__ = ["AGREE_KEY", "Cached", "ShmAllreduce", "ShmUnavailable"]

log = logging.getLogger("asynccoll.comm")

#: the cache key of the collective that checks the others' definitions
AGREE_KEY: tuple[Any, ...] = ("agree",)


class Cached:
    """A cached synchronous collective: its executor, scratch buffers and a lock (one at a time)."""

    def __init__(self, ex: Executor, scratch: dict[str, Any], own: Any) -> None:
        self.ex = ex
        self.scratch = scratch
        self.own = own  # the bound "data" buffer when small (else None: rebind per call)
        self.lock = asyncio.Lock()


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
    return (AGREE_KEY, ("barrier",), ("shm_ok",), ("shm", 0, *key), ("shm", 1, *key))


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


class ShmAllreduce:
    """The shared-memory allreduces of :class:`~.dense.DenseOps` (module doc)."""

    # the state of :class:`~.dense.DenseOps` these methods use (set by its ``__init__``)
    transport: Transport
    rank: int
    size: int
    router: Router
    layout: Layout | None
    _next_id: Callable[[], int]
    _kernels: KernelRegistry
    _live: LiveOps
    _writer: TraceWriter | None
    _shm: dict[tuple[Any, ...], _Shm]
    _cma: dict[tuple[Any, ...], Cached]
    _cma_pids: list[int] | None
    _cma_held: list[Any]
    _reserved: dict[tuple[Any, ...], int]
    _arenas: dict[int, _Arena]

    # the cache's own (this class is a part of it)
    async def _hosts(self, timeout: float | None) -> tuple[bool, int]:
        raise NotImplementedError

    def _reserve(self, *keys: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _lock(self, key: tuple[Any, ...]) -> asyncio.Lock:
        raise NotImplementedError

    async def _execute(self, ex: Executor, timeout: float | None, what: str) -> None:
        raise NotImplementedError

    async def call(self, key: tuple[Any, ...], build: Callable[[], Schedule], data: Any,
                   timeout: float | None, *, agree: bool = True) -> None:
        raise NotImplementedError

    async def agree_on(self, kind: str, what: dict[str, Any], timeout: float | None) -> None:
        raise NotImplementedError

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
        self._reserve(AGREE_KEY, ("barrier",), ("shm_ok",))
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
            self._reserve(("cma", *key), AGREE_KEY, ("cma_probe",), ("shm_ok",))
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
                    entry = self._cma[key] = Cached(ex, scratch, None)
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
        self._reserve(("hosts",), AGREE_KEY, ("barrier",), ("shm_ok",))

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
