"""The sparse allreduce (SparCML, with QSGD) in virtual time, on every rank of a world.

:class:`SimSparse` runs the runtime's own schedules (:func:`~asynccoll.collectives.sparse.
schedules.build_sparse_allreduce`) and kernels (:data:`~asynccoll.collectives.sparse.kernels.
SPARSE_KERNELS`) through :class:`~.engine.SimExecutor`, with the buffers the runtime's
:class:`~asynccoll.comm.sparse.SparseAllreduce` binds, so its results are the runtime's, bit
for bit (the QSGD seed included: the same ``seed`` and the same run number draw the same
rounding). **Data mode only**: a sparse message's size is what the data makes it (a stream of
the nonzeros seen so far, or the dense switch), so the simulator must run the kernels to know
what each send costs; the engine prices a send by the bytes of the payload its compute op
produced, not by the slot's capacity. That makes it slower per op than the timing-only dense
and partial handles: use it for P in the tens to hundreds, not thousands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives.sparse.kernels import SPARSE_KERNELS
from ..collectives.sparse.schedules import (
    build_sparse_allreduce,
    choose_algorithm,
    load_stream,
    read_result,
)
from ..collectives.sparse.streams import SparseVector
from ..sched import Schedule
from .engine import SimExecutor, SimWorld

__all__ = ["SimSparse"]

#: ``on_return(result, rank)``: a SparseVector or a dense array, as the runtime returns it
SparseReturned = Callable[[Any, int], None]


class SimSparse:
    """A sparse allreduce of length-``size`` vectors on every rank of ``world``, reusable (one
    execution per call round; every rank calls once per round). Arguments as
    :class:`~asynccoll.comm.sparse.SparseAllreduce`: ``algorithm`` or ``density`` to choose
    it, ``delta``, ``quantize``, ``bucket``, ``seed``. ``call(rank, x, on_return)``: the rank
    enters with ``x`` (a SparseVector or a 1-D array of ``size``); ``on_return(result, rank)``
    runs when its execution completes. Raises ``ValueError`` naming a bad argument."""

    def __init__(self, world: SimWorld, size: int, dtype: Any = np.float32, *,
                 density: float | None = None, algorithm: str | None = None,
                 delta: float | None = None, quantize: int | None = None, bucket: int = 512,
                 seed: int = 0, sched_id: int = 4) -> None:
        P = world.world_size
        dt = np.dtype(dtype)
        if algorithm is None:
            algorithm = "dsar_split_allgather" if quantize is not None else \
                choose_algorithm(density, P, size, dt, delta)
        self.world = world
        self.size = int(size)
        self.dtype = dt
        self.algorithm = algorithm
        self.seed = seed
        scheds = _sparse_schedules(P, self.size, dt.str, algorithm, delta, quantize, bucket)
        md = scheds[0].meta["delta"]
        self.delta = float("inf") if md is None else float(md)
        self._scheds = scheds
        self._bufs: list[dict[str, np.ndarray]] = [self._empty(s) for s in scheds]
        self._runs = [0] * P
        self._waiter: list[SparseReturned | None] = [None] * P
        self.executors = [SimExecutor(world, s, sched_id=sched_id, buffers=self._bufs[r],
                                      kernels=SPARSE_KERNELS,
                                      on_complete=functools.partial(self._on_complete, r))
                          for r, s in enumerate(scheds)]

    @staticmethod
    def _empty(s: Schedule) -> dict[str, np.ndarray]:
        bufs: dict[str, np.ndarray] = {}
        for slot, spec in s.slots.items():
            assert spec.count is not None
            bufs[slot] = np.empty(spec.count, np.dtype(spec.dtype or "u1"))
        return bufs

    def call(self, rank: int, x: SparseVector | np.ndarray, on_return: SparseReturned) -> None:
        """Rank ``rank`` enters now with ``x``."""
        if self._waiter[rank] is not None:
            raise ValueError(f"rank {rank} is already in a sparse allreduce")
        size = x.size if isinstance(x, SparseVector) else np.asarray(x).size
        if size != self.size:
            raise ValueError(f"x has size {size}, the allreduce expects {self.size}")
        s, bufs = self._scheds[rank], self._bufs[rank]
        load_stream(bufs[s.meta["input"]], x, self.size, self.dtype, self.delta)
        if "seed" in bufs:  # as SparseAllreduce: the run number moves the QSGD rounding
            bufs["seed"][0] = np.uint64((self.seed * 1_000_003 + self._runs[rank]) % (1 << 63))
        self._waiter[rank] = on_return
        self.executors[rank].start()

    def _on_complete(self, rank: int, e: int) -> None:
        s = self._scheds[rank]
        res = read_result(self._bufs[rank][s.meta["result"]], self.size, self.dtype)
        if isinstance(res, SparseVector):  # the buffers are reused by the next round
            res = SparseVector(res.indices.copy(), res.values.copy(), res.size, check=False)
        else:
            res = np.array(res, copy=True)
        self._runs[rank] += 1
        cb = self._waiter[rank]
        self._waiter[rank] = None
        assert cb is not None
        w = self.world
        w.at(w.now, cb, res, rank)


@functools.lru_cache(maxsize=8)
def _sparse_schedules(world_size: int, size: int, dtype: str, algorithm: str,
                      delta: float | None, quantize: int | None,
                      bucket: int) -> tuple[Schedule, ...]:
    return tuple(build_sparse_allreduce(r, world_size, size, np.dtype(dtype),
                                        algorithm=algorithm, delta=delta, quantize=quantize,
                                        bucket=bucket)
                 for r in range(world_size))
