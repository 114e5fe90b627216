"""A synchronous dense allreduce and a barrier in virtual time, on every rank of a world."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import KERNELS
from ..collectives.dense import allreduce as build_dense_allreduce
from ..collectives.dense import barrier as build_dense_barrier
from ..collectives.dense import scratch_buffers
from ..results import PartialResult
from ..sched import Schedule
from .engine import SimExecutor, SimWorld
from .handle import Returned

__all__ = ["SimBarrier", "SimSync"]


class SimSync:
    """A synchronous dense allreduce of ``like``-shaped data on every rank of ``world``
    (:func:`~asynccoll.collectives.dense.allreduce`, one non-persistent executor per rank).
    A call returns when the rank's execution completes, as a :class:`PartialResult` with every
    rank a contributor (so the same statistics apply). ``data``: as :class:`SimPartial`."""

    def __init__(self, world: SimWorld, like: Any, *, op: str = "sum", data: bool = True,
                 algorithm: str | None = None, sched_id: int = 2) -> None:
        like = np.asarray(like)
        P = world.world_size
        self.world = world
        self.data = data
        self.shape = like.shape
        self.dtype = like.dtype
        self.executors: list[SimExecutor] = []
        self._bufs: list[dict[str, Any]] = []
        self._waiter: list[Returned | None] = [None] * P
        scheds = _dense_schedules(P, int(like.size), like.dtype.str, op, algorithm)
        for r in range(P):
            bufs: dict[str, Any] | None = None
            if data:
                bufs = {"data": np.zeros(like.size, like.dtype), **scratch_buffers(scheds[r])}
                self._bufs.append(bufs)
            self.executors.append(SimExecutor(
                world, scheds[r], sched_id=sched_id, buffers=bufs,
                kernels=KERNELS if data else None,
                on_complete=functools.partial(self._on_complete, r)))
        self._all = frozenset(range(P))

    def call(self, rank: int, x: Any, on_return: Returned) -> None:
        """Rank ``rank`` calls now; ``on_return`` runs when its allreduce completes."""
        if self.data:
            self._bufs[rank]["data"][...] = np.asarray(x, self.dtype).reshape(-1)
        self._waiter[rank] = on_return
        self.executors[rank].start()

    def _on_complete(self, rank: int, e: int) -> None:
        value = self._bufs[rank]["data"].copy().reshape(self.shape) if self.data else None
        P = self.world.world_size
        res = PartialResult(value, e, True, self._all, P, 0, self._all)
        cb = self._waiter[rank]
        self._waiter[rank] = None
        assert cb is not None
        w = self.world
        w.at(w.now, cb, res, rank)


class SimBarrier:
    """A dense barrier (:func:`~asynccoll.collectives.dense.barrier`) on every rank:
    ``enter(rank, on_exit)``; ``on_exit(rank)`` runs when the rank leaves it."""

    def __init__(self, world: SimWorld, sched_id: int = 3) -> None:
        P = world.world_size
        self._waiter: list[Callable[[int], None] | None] = [None] * P
        self.executors = [SimExecutor(world, s, sched_id=sched_id,
                                      on_complete=functools.partial(self._done, s.rank))
                          for s in _barrier_schedules(P)]
        self.world = world

    def enter(self, rank: int, on_exit: Callable[[int], None]) -> None:
        self._waiter[rank] = on_exit
        self.executors[rank].start()

    def _done(self, rank: int, e: int) -> None:
        cb = self._waiter[rank]
        self._waiter[rank] = None
        assert cb is not None
        w = self.world
        w.at(w.now, cb, rank)


@functools.lru_cache(maxsize=8)
def _dense_schedules(world_size: int, count: int, dtype: str, op: str,
                     algorithm: str | None) -> tuple[Schedule, ...]:
    return tuple(build_dense_allreduce(r, world_size, count, dtype, op, algorithm)
                 for r in range(world_size))


@functools.lru_cache(maxsize=8)
def _barrier_schedules(world_size: int) -> tuple[Schedule, ...]:
    return tuple(build_dense_barrier(r, world_size) for r in range(world_size))
