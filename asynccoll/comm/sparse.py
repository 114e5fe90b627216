"""The sparse allreduce runtime (SparCML; the schedules are :mod:`asynccoll.collectives.sparse`'s).

* :class:`SparseAllreduce` owns one sparse allreduce schedule and its executor over a
  transport, reusable (one execution per :meth:`~SparseAllreduce.run`); :func:`sparse_allreduce`
  runs one, for code that holds a transport rather than a Communicator.
* :class:`SparseOps` holds the entries of ``Communicator.sparse_allreduce``: each distinct
  ``(size, dtype, algorithm, quantize, delta, bucket, seed)`` gets one SparseAllreduce (its
  schedule built and committed once) and a schedule id from the communicator's counter at its
  first call, like the dense collectives: ranks that call their collectives in the same order
  agree on the ids. Calls of one entry run one at a time (a lock); a failed, timed-out or
  cancelled call drops its entry (receives retired) and the next call of that key starts a
  fresh one under a new id, as the dense collectives do.
* :class:`SparseAllreduceHandle` (``Communicator.sparse_allreduce_handle``) is a named,
  persistent one, its schedule id derived from its name.
* On one host the split algorithms go through shared memory: :class:`ShmSparseAllreduce` for
  ``comm.sparse_allreduce`` (segments mapped by a collective step at a key's first call),
  :class:`HandleShmSparseAllreduce` for handles (segments made without one).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ..collectives.partial import SHM_ATTACH
from ..collectives.sparse import quantize as qsgd
from ..collectives.sparse.kernels import SPARSE_KERNELS
from ..collectives.sparse.schedules import (
    build_sparse_allreduce,
    choose_algorithm,
    load_stream,
    read_result,
)
from ..collectives.sparse.shm import build_sparse_shm_allreduce
from ..collectives.sparse.streams import SparseVector
from ..errors import BusyError, CollectiveTimeoutError, PeerLostError, TransportClosedError
from ..sched import Executor, Kernel, LiveOps, Schedule
from ..transport.base import Transport
from .dense import ShmUnavailable
from .shm import PartialSegments
from .tensors import as_host, to_device

if TYPE_CHECKING:
    from .dense import DenseOps

__all__ = ["HandleShmSparseAllreduce", "ShmSparseAllreduce", "SparseAllreduce",
           "SparseAllreduceHandle", "SparseOps", "sparse_allreduce"]

T = TypeVar("T")
log = logging.getLogger("asynccoll.comm")


# -- one sparse allreduce over a transport -------------------------------------------------------

class SparseAllreduce:
    """A sparse allreduce of length-``size`` vectors for the rank of ``transport``, reusable.

    Every rank must construct it with the same ``size``, ``dtype``, algorithm, ``delta``,
    ``quantize`` and ``sched_id``. :meth:`run` may be called repeatedly (one execution each, in
    the same order on every rank); each run binds fresh buffers, so earlier results stay valid
    and are never copied. After a failed or timed-out run, :meth:`close` it. The algorithm is
    ``algorithm``, or chosen from ``density`` (:func:`choose_algorithm
    <asynccoll.collectives.sparse.schedules.choose_algorithm>`; ``dsar_split_allgather`` with
    ``quantize``). ``kernels``: the executor's registry (default
    :data:`~asynccoll.collectives.sparse.kernels.SPARSE_KERNELS`); ``live``: a registry the
    executor is added to (a Communicator's, for dumps of what it waits on). Raises
    ``ValueError`` naming a bad argument.
    """

    def __init__(self, transport: Transport, size: int, dtype: Any = np.float32, *,
                 sched_id: int, density: float | None = None, algorithm: str | None = None,
                 delta: float | None = None, quantize: int | None = None, bucket: int = 512,
                 seed: int = 0, kernels: Mapping[str, Kernel] | None = None,
                 live: LiveOps | None = None) -> None:
        dt = np.dtype(dtype)
        if algorithm is None:
            algorithm = "dsar_split_allgather" if quantize is not None else \
                choose_algorithm(density, transport.world_size, size, dt, delta)
        self.transport = transport
        self.size = size
        self.dtype = dt
        self.seed = seed
        self.schedule = build_sparse_allreduce(transport.rank, transport.world_size, size, dt,
                                               algorithm=algorithm, delta=delta,
                                               quantize=quantize, bucket=bucket)
        self.algorithm = algorithm
        md = self.schedule.meta["delta"]
        self.delta = math.inf if md is None else float(md)
        self.sched_id = sched_id
        self.executor: Executor | None = None
        self.runs = 0
        self._kernels = SPARSE_KERNELS if kernels is None else kernels
        self._live = live

    def _buffers(self, x: SparseVector | np.ndarray) -> dict[str, np.ndarray]:
        bufs: dict[str, np.ndarray] = {}
        for slot, spec in self.schedule.slots.items():
            assert spec.count is not None
            bufs[slot] = np.empty(spec.count, np.dtype(spec.dtype or "u1"))
        load_stream(bufs[self.schedule.meta["input"]], x, self.size, self.dtype, self.delta)
        if "seed" in bufs:
            bufs["seed"][0] = np.uint64((self.seed * 1_000_003 + self.runs) % (1 << 63))
        return bufs

    def check(self, x: Any) -> SparseVector | np.ndarray:
        """``x`` as :meth:`run` takes it (flat), or ``TypeError``/``ValueError`` naming it."""
        if isinstance(x, SparseVector):
            if x.size != self.size:
                raise ValueError(f"x has size {x.size}, the allreduce expects {self.size}")
            if x.values.dtype != self.dtype:
                raise ValueError(f"x has dtype {x.values.dtype}, the allreduce expects "
                                 f"{self.dtype}")
            return x
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a SparseVector or a NumPy array, got "
                            f"{type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ValueError("x must be C-contiguous")
        if x.size != self.size or x.dtype != self.dtype:
            raise ValueError(f"x has {x.size} entries of {x.dtype}, the allreduce expects "
                             f"{self.size} of {self.dtype}")
        return x.reshape(-1)

    async def run(self, x: SparseVector | np.ndarray, *, timeout: float | None = None
                  ) -> SparseVector | np.ndarray:
        """Sum ``x`` over all ranks: a SparseVector (sorted unique indices, no exact zeros)
        while the sum fits the sparse form, else a dense array, by the rule of the algorithm
        (docs/sparse.md, *What comes back*); bitwise identical on every rank.

        Raises ``TypeError``/``ValueError`` naming ``x``, :class:`CollectiveTimeoutError`
        listing what is awaited, or the execution's error (``ExecutionError``,
        ``PeerLostError``).
        """
        x = self.check(x)
        bufs = self._buffers(x)
        if self.executor is None:
            self.executor = Executor(self.schedule, self.transport, bufs,
                                     sched_id=self.sched_id, kernels=self._kernels)
            if self._live is not None:
                self._live.add(self.executor)
        else:
            self.executor.bind(bufs)
        self.executor.start()
        await self.executor.wait(timeout)
        self.runs += 1
        return read_result(bufs[self.schedule.meta["result"]], self.size, self.dtype)

    def close(self) -> None:
        """Stop the executor and retire its receives."""
        if self.executor is not None:
            self.executor.close()


class ShmSparseAllreduce:
    """A sparse split allgather through this host's shared memory
    (:mod:`asynccoll.collectives.sparse.shm`): one executor over the segments of every rank
    (``segments``, mapped, in rank order); :meth:`run` as :class:`SparseAllreduce`'s (a fresh
    result buffer per call). Made by :meth:`SparseOps.run` when every rank is on this host."""

    def __init__(self, schedule: Schedule, transport: Transport, segments: list[Any], *,
                 sched_id: int, kernels: Mapping[str, Kernel] | None,
                 live: LiveOps | None) -> None:
        self.schedule = schedule
        self.algorithm = str(schedule.meta["algorithm"])
        self.size = int(schedule.meta["size"])
        self.dtype = np.dtype(schedule.meta["dtype"])
        md = schedule.meta["delta"]
        self.delta = math.inf if md is None else float(md)
        self._segments = segments
        self._arrays = self._segment_arrays()
        #: this rank's input region (its own segment is the same array for the object's life)
        self._input = self._arrays[str(schedule.meta["input"])][:int(schedule.meta["input_bytes"])]
        # bound again at every run, with a fresh result buffer (this one is never touched)
        self._out = self._result_buffer()
        self.executor = Executor(schedule, transport, {**self._arrays,
                                                       schedule.meta["result"]: self._out},
                                 sched_id=sched_id,
                                 kernels=SPARSE_KERNELS if kernels is None else kernels)
        self._live = live
        if live is not None:
            live.add(self.executor)

    def _segment_arrays(self) -> dict[str, np.ndarray]:
        """The arrays to bind to ``seg{q}`` for every rank q."""
        return {f"seg{q}": seg.array(np.uint8, self.schedule.slots[f"seg{q}"].count)
                for q, seg in enumerate(self._segments)}

    def _result_buffer(self) -> np.ndarray:
        spec = self.schedule.slots[self.schedule.meta["result"]]
        assert spec.count is not None
        return np.empty(spec.count, np.dtype(spec.dtype or "u1"))

    async def run(self, x: SparseVector | np.ndarray, *, timeout: float | None = None
                  ) -> SparseVector | np.ndarray:
        """As :meth:`SparseAllreduce.run` (``x`` checked by the caller)."""
        load_stream(self._input, x, self.size, self.dtype, self.delta)
        out = self._out = self._result_buffer()
        self.executor.bind({**self._arrays, self.schedule.meta["result"]: out})
        self.executor.start()
        await self.executor.wait(timeout)
        return read_result(out, self.size, self.dtype)

    def close(self) -> None:
        """Stop the executor and unmap the segments (their files are gone already)."""
        self.executor.close()
        if self._live is not None:
            self._live.discard(self.executor)
        self._arrays.clear()
        for seg in self._segments:
            seg.close()


class HandleShmSparseAllreduce(ShmSparseAllreduce):
    """The shared-memory form of a persistent sparse handle
    (:meth:`Communicator.sparse_allreduce_handle
    <asynccoll.Communicator.sparse_allreduce_handle>`), whose segments are made without a
    collective step, as a partial handle's (:class:`~.shm.PartialSegments`, one set): a
    handle's schedule id comes from its name and stays out of the communicator's order, which
    the collective mapping of :meth:`SparseOps.run` (a barrier and a flag allreduce, in that
    order) would break.

    * This rank's segment is created with the handle (``segments``); a peer's is mapped by the
      schedule's :data:`~asynccoll.collectives.partial.SHM_ATTACH` op, in the first execution,
      once every peer said its input is in (a peer does so only after creating its segment).
    * This rank unlinks its own after its first completed execution: that completion needed
      every peer's "block in", which a peer sends after its reduce, so after its attach had
      mapped every segment.
    * On a failure or at :meth:`close`, this rank's is unlinked and a lost peer's, which it
      cannot unlink itself, by name (``lost``: the first rank the communicator knows lost).
    """

    def __init__(self, schedule: Schedule, transport: Transport, segments: PartialSegments, *,
                 sched_id: int, kernels: Mapping[str, Kernel] | None, live: LiveOps | None,
                 lost: Callable[[], PeerLostError | None]) -> None:
        self._parts = segments
        self._rank = transport.rank
        self._lost = lost
        own = dict(SPARSE_KERNELS if kernels is None else kernels)
        own[SHM_ATTACH] = self._attach
        super().__init__(schedule, transport, [], sched_id=sched_id, kernels=own, live=live)

    def _segment_arrays(self) -> dict[str, np.ndarray]:
        bufs = self._parts.buffers(0)
        return {f"seg{q}": bufs["mine"] if q == self._rank else bufs[f"peer{q}"]
                for q in range(self._parts.world_size)}

    def _attach(self, out: Any, inputs: Any, params: Any, msgs: Any) -> None:
        """The schedule's attach op: map the peers' segments (the first time) and bind them."""
        if self._parts.attach_or_wait(self.executor):
            self._arrays = self._segment_arrays()
            self.executor.bind({**self._arrays, self.schedule.meta["result"]: self._out})

    async def run(self, x: SparseVector | np.ndarray, *, timeout: float | None = None
                  ) -> SparseVector | np.ndarray:
        res = await super().run(x, timeout=timeout)
        self._parts.unlink_own()  # (idempotent: once, after the first)
        return res

    def close(self) -> None:
        """Stop the executor, unlink this rank's segment and a lost peer's, unmap them."""
        err = self.executor.error
        super().close()
        for e in (err, self._lost()):
            if isinstance(e, PeerLostError):
                self._parts.forget(e.rank)
        self._parts.close()


async def sparse_allreduce(transport: Transport, x: SparseVector | np.ndarray, *,
                           sched_id: int, density: float | None = None,
                           algorithm: str | None = None, quantize: int | None = None,
                           delta: float | None = None, bucket: int = 512, seed: int = 0,
                           timeout: float | None = None) -> SparseVector | np.ndarray:
    """Sum sparse (or sparsified dense) ``x`` over every rank of ``transport``.

    ``x``: a :class:`SparseVector` or a 1-D NumPy array (its nonzeros are the contribution; a
    CuPy array is staged through host memory and the result returned as CuPy).
    ``density``: the expected fraction of nonzeros per rank, the same on every rank, to choose
    the algorithm; ``algorithm`` overrides it. ``quantize``: 2, 4 or 8 to QSGD-quantise the
    dense stage (implies ``dsar_split_allgather``). ``delta``: the switch point (default
    ``N*isize/(c+isize)``; ``0`` always dense, ``math.inf`` never). ``sched_id`` must be the
    same on every rank and unused by concurrent collectives.

    Returns what :meth:`SparseAllreduce.run` returns, and raises as it does.
    """
    host, device = as_host(x)
    dt = host.values.dtype if isinstance(host, SparseVector) else host.dtype
    op = SparseAllreduce(transport, host.size, dt, sched_id=sched_id, density=density,
                         algorithm=algorithm, delta=delta, quantize=quantize, bucket=bucket,
                         seed=seed)
    try:
        res = await op.run(host, timeout=timeout)
    finally:
        op.close()
    return to_device(res) if device else res


# -- a communicator's sparse allreduces ----------------------------------------------------------

class _Entry:
    def __init__(self, op: SparseAllreduce) -> None:
        self.op = op
        self.lock = asyncio.Lock()
        #: whether the first call still has to try shared memory (:meth:`SparseOps._try_shm`)
        self.shm_pending = False
        self.shm: ShmSparseAllreduce | None = None

    def close(self) -> None:
        self.op.close()
        if self.shm is not None:
            self.shm.close()


class SparseOps:
    """The sparse allreduces of one communicator (module doc); lives on its loop."""

    def __init__(self, transport: Transport, next_id: Callable[[], int], *,
                 kernels: Mapping[str, Kernel] | None = None,
                 live: LiveOps | None = None) -> None:
        self._transport = transport
        self._next_id = next_id
        self._kernels = kernels  # the communicator's registries, passed to every executor
        self._live = live
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._named: dict[str, _Entry] = {}
        #: the communicator's dense collectives, whose host layout and segment setup the
        #: shared-memory path uses (set by the communicator; None: never shared memory)
        self.dense: DenseOps | None = None
        self._warned = False  # that segments could not be had (logged once)

    def resolve(self, size: int, dtype: np.dtype[Any], density: float | None,
                algorithm: str | None, quantize: int | None, delta: float | None) -> str:
        """The algorithm a call uses (validating ``density`` and ``quantize``)."""
        if density is not None and (isinstance(density, bool)
                                    or not isinstance(density, (int, float))):
            raise ValueError(f"density must be a fraction in 0..1 or None, got {density!r}")
        if quantize is not None:
            qsgd.levels(quantize)
        if algorithm is not None:
            if density is not None:
                choose_algorithm(density, self._transport.world_size, size, dtype, delta)
            return algorithm
        if quantize is not None:
            return "dsar_split_allgather"
        return choose_algorithm(density, self._transport.world_size, size, dtype, delta)

    def _make(self, size: int, dtype: Any, sched_id: int, *, algorithm: str,
              quantize: int | None, delta: float | None, bucket: int, seed: int
              ) -> SparseAllreduce:
        return SparseAllreduce(self._transport, size, dtype, sched_id=sched_id,
                               algorithm=algorithm, delta=delta, quantize=quantize,
                               bucket=bucket, seed=seed, kernels=self._kernels, live=self._live)

    async def run(self, x: SparseVector | np.ndarray, *, algorithm: str,
                  quantize: int | None, delta: float | None, bucket: int, seed: int,
                  timeout: float | None,
                  agree: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                  ) -> SparseVector | np.ndarray:
        """One sparse allreduce of host ``x`` with the cached entry of its key. ``agree``:
        awaited with the definition at the key's first use (it raises when the ranks disagree;
        the entry is then dropped)."""
        size, dt = (x.size, x.values.dtype) if isinstance(x, SparseVector) else (x.size, x.dtype)
        key = (int(size), np.dtype(dt).str, algorithm, quantize, delta, int(bucket), int(seed))
        while True:
            entry = self._entries.get(key)
            fresh = entry is None
            if entry is None:
                # Built before taking an id (its executor is made at the first run): a bad
                # argument must not shift the ids.
                op = self._make(int(size), dt, 0, algorithm=algorithm, quantize=quantize,
                                delta=delta, bucket=bucket, seed=seed)
                op.sched_id = self._next_id()
                entry = _Entry(op)
                if self.dense is not None and self._transport.world_size > 1:
                    # The ids a shared-memory setup may take, now, before any await (see
                    # DenseOps._reserve), and whatever this call's arguments: reserved only for
                    # some, a call the ranks disagree on would leave their ids out of step.
                    self.dense.reserve_segment_setup()
                entry.shm_pending = self._shm_eligible(algorithm, quantize)
                self._entries[key] = entry
            # The lock is FIFO and taken before the first use's agreement (an await): a call
            # made meanwhile queues behind the first instead of overtaking it (its run would
            # pair with the peers' first call).
            async with entry.lock:
                if self._entries.get(key) is not entry:
                    continue  # dropped by the call before this one: start afresh
                try:
                    if fresh and agree is not None:
                        await agree({"kind": "sparse_allreduce", "size": int(size),
                                     "dtype": np.dtype(dt).str, "algorithm": algorithm,
                                     "quantize": quantize, "delta": delta,
                                     "bucket": int(bucket), "seed": int(seed)})
                    if entry.shm_pending:
                        entry.shm_pending = False
                        entry.shm = await self._try_shm(entry.op, timeout)
                    if self.dense is not None:  # a loss learned during the steps above
                        self.dense.raise_if_lost()
                    if entry.shm is not None:
                        return await entry.shm.run(entry.op.check(x), timeout=timeout)
                    return await entry.op.run(x, timeout=timeout)
                except BaseException:
                    # A disagreement, or a failed, timed-out or cancelled run (the executor
                    # left mid-way): drop the entry; the next call starts a fresh one.
                    entry.close()
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                    raise

    def _shm_eligible(self, algorithm: str, quantize: int | None) -> bool:
        """Whether a key's first call tries shared memory: the split algorithms without
        quantisation (whose point is fewer bytes on a network), more than one rank, not
        turned off; whether every rank is on this host is learned at that call."""
        return self.dense is not None and self.dense.router.sparse_allreduce(algorithm, quantize)

    async def _try_shm(self, op: SparseAllreduce, timeout: float | None
                       ) -> ShmSparseAllreduce | None:
        """The shared-memory form of ``op`` when every rank is on this host and the segments
        could be had (collective: every rank gets the same answer), else None (logged once)."""
        assert self.dense is not None
        same, _token = await self.dense.hosts(timeout)
        if not same:
            return None
        t = self._transport
        dense = op.algorithm == "dsar_split_allgather"
        sched = build_sparse_shm_allreduce(t.rank, t.world_size, op.size, op.dtype,
                                           delta=op.delta, dense=dense)
        nbytes = int(sched.meta["input_bytes"]) + int(sched.meta["block_bytes"])
        try:
            mapped = await self.dense.map_segments([op.sched_id], nbytes, timeout)
        except ShmUnavailable as exc:
            # Every rank learns it together, for this collective only: a flag that turned the
            # path off for later ones would take effect at a different moment on each rank
            # (where another's setup is under way), and the ranks would part ways. Each new
            # collective tries again (one barrier and one flag allreduce, at its first call).
            if not self._warned:
                self._warned = True
                log.warning("%s; this sparse allreduce goes over the network (and every later "
                            "one whose segments cannot be had either)", exc)
            return None
        segs = mapped[0]
        try:
            return ShmSparseAllreduce(sched, t, segs, sched_id=op.sched_id,
                                      kernels=self._kernels, live=self._live)
        except BaseException:
            for seg in segs:
                seg.close()
            raise

    def named(self, name: str, sched_id: int, size: int, dtype: Any, *, algorithm: str,
              quantize: int | None, delta: float | None, bucket: int, seed: int,
              shm_token: int | None = None) -> _Entry:
        """A persistent sparse allreduce under ``name`` (closed with the others until
        :meth:`release`): its SparseAllreduce, and with ``shm_token`` (the job's segment token,
        every rank on this host) its shared-memory form, this rank's segment created now
        (:class:`HandleShmSparseAllreduce`; ``OSError`` when it cannot be). Raises
        ``ValueError`` naming ``name`` when it is in use."""
        if name in self._named:
            raise ValueError(f"name {name!r} is already used by a sparse allreduce handle of "
                             "this communicator")
        entry = _Entry(self._make(size, dtype, sched_id, algorithm=algorithm, quantize=quantize,
                                  delta=delta, bucket=bucket, seed=seed))
        if shm_token is not None:
            t = self._transport
            sched = build_sparse_shm_allreduce(
                t.rank, t.world_size, size, dtype, delta=entry.op.delta,
                dense=algorithm == "dsar_split_allgather", attach=SHM_ATTACH)
            nbytes = int(sched.meta["input_bytes"]) + int(sched.meta["block_bytes"])
            segs = PartialSegments(shm_token, sched_id, t.rank, t.world_size, nbytes, np.uint8,
                                   parts=1)
            try:
                entry.shm = HandleShmSparseAllreduce(
                    sched, t, segs, sched_id=sched_id, kernels=self._kernels, live=self._live,
                    lost=(lambda: None) if self.dense is None else self.dense.lost)
            except BaseException:
                segs.close()
                raise
        self._named[name] = entry
        return entry

    def release(self, name: str) -> None:
        """Close the persistent sparse allreduce under ``name`` and free the name."""
        entry = self._named.pop(name, None)
        if entry is not None:
            entry.close()

    def close(self) -> None:
        """Stop every executor (a waiting call fails with TransportClosedError)."""
        for e in self._entries.values():
            e.close()
        self._entries.clear()
        for entry in self._named.values():
            entry.close()
        self._named.clear()


class _Run(Protocol):
    def __call__(self, coro: Coroutine[Any, Any, T], /) -> Coroutine[Any, Any, T]: ...


class SparseAllreduceHandle:
    """A named, persistent sparse allreduce of a Communicator: ``await h(x)`` per step.

    Made by :meth:`Communicator.sparse_allreduce_handle
    <asynccoll.Communicator.sparse_allreduce_handle>`. Its schedule is built once and its
    schedule id comes from its ``name``, so it does not take part in the order of the other
    collectives; its own calls must come in the same order on every rank. One call at a time
    (:class:`~asynccoll.BusyError` otherwise). A failed, timed-out or cancelled call closes the
    handle (the executor is left mid-way); later calls raise
    :class:`~asynccoll.TransportClosedError`, as they do after :meth:`close` or
    ``comm.close()``.
    """

    def __init__(self, entry: _Entry, name: str, *, run: _Run,
                 release: Callable[[str], None], timeout: float | None) -> None:
        op = entry.op
        self._op, self._run, self._release = op, run, release
        #: the form that runs: through shared memory when every rank is on this host
        self._runner: SparseAllreduce | ShmSparseAllreduce = \
            op if entry.shm is None else entry.shm
        #: whether the data goes through this host's shared memory
        self.shm = entry.shm is not None
        self._completed = 0  # calls completed (a first call's timeout says more)
        self._busy = self._closed = False
        self.name = name
        self.algorithm = op.algorithm
        self.timeout = timeout

    async def __call__(self, x: Any, timeout: float | None = None) -> Any:
        """Sum ``x`` (a :class:`~asynccoll.SparseVector` or an array of the handle's size and
        dtype; CuPy staged through host memory) over all ranks. Returns what
        :meth:`Communicator.sparse_allreduce <asynccoll.Communicator.sparse_allreduce>`
        returns (dense results 1-D); ``timeout``: default the handle's. Raises
        ``TypeError``/``ValueError`` naming ``x``, :class:`~asynccoll.CollectiveTimeoutError`,
        the execution's error. Costs one execution of the schedule.
        """
        host, device = as_host(x)
        res = await self._run(self._call(host, self.timeout if timeout is None else timeout))
        return to_device(res) if device else res

    async def close(self) -> None:
        """Stop the executor and free the name (local, not collective). Idempotent."""
        await self._run(self._close())

    def __repr__(self) -> str:
        return (f"SparseAllreduceHandle(name={self.name!r}, size={self._op.size}, "
                f"dtype={self._op.dtype}, algorithm={self.algorithm!r}, shm={self.shm})")

    async def _call(self, x: SparseVector | np.ndarray, timeout: float | None
                    ) -> SparseVector | np.ndarray:
        if self._closed:
            raise TransportClosedError(f"sparse allreduce {self.name!r} is closed")
        if self._busy:
            raise BusyError(f"sparse allreduce {self.name!r} already has a call under way; "
                            "one at a time per handle")
        x = self._op.check(x)
        self._busy = True
        try:
            res = await self._runner.run(x, timeout=timeout)
            self._completed += 1
            return res
        except CollectiveTimeoutError as exc:
            await self._close()  # the executor is left mid-way
            if self._completed:
                raise
            # The handle's path is chosen at its creation on each rank alone: ranks that chose
            # differently wait for messages that never come. Say so where it shows.
            raise CollectiveTimeoutError(
                f"{exc}; the first call of sparse handle {self.name!r}: every rank must create "
                "it with the same size, dtype, algorithm, quantize, delta and shm, under the same "
                f"ASYNCCOLL_SHM (this rank's goes "
                f"{'through shared memory' if self.shm else 'over the network'})",
                exc.pending) from exc
        except BaseException:
            await self._close()  # the executor is left mid-way
            raise
        finally:
            self._busy = False

    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self.name)
