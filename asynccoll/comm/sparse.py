"""``Communicator.sparse_allreduce``: cached sparse allreduce schedules on the progress engine.

Each distinct ``(size, dtype, algorithm, quantize, delta, bucket, seed)`` gets one
:class:`~asynccoll.collectives.sparse.schedules.SparseAllreduce` (its schedule built and committed
once) and a schedule id from the communicator's counter at its first call, like the dense
collectives: ranks that call their collectives in the same order agree on the ids. Calls of
one entry run one at a time (a lock); a failed, timed-out or cancelled call drops its entry
(receives retired) and the next call of that key starts a fresh one under a new id, as the dense
collectives do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ..buffers import is_cupy
from ..collectives.sparse import quantize as qsgd
from ..collectives.sparse.schedules import SparseAllreduce, choose_algorithm
from ..collectives.sparse.streams import SparseVector
from ..transport.base import Transport

__all__ = ["SparseOps", "as_host"]


class _Entry:
    def __init__(self, op: SparseAllreduce) -> None:
        self.op = op
        self.lock = asyncio.Lock()


def as_host(x: Any) -> tuple[SparseVector | np.ndarray, bool]:
    """``x`` in host memory and whether it was on the device (CuPy). Raises ``TypeError``
    naming ``x`` unless it is a SparseVector or an array."""
    if isinstance(x, SparseVector):
        if is_cupy(x.values):
            dev: Any = x
            return SparseVector(dev.indices.get(), dev.values.get(), x.size, check=False), True
        return x, False
    if isinstance(x, np.ndarray):
        return x, False
    if is_cupy(x):
        host: np.ndarray = x.get()
        return host, True
    raise TypeError(f"x must be a SparseVector or an array, got {type(x).__name__}")


def to_device(res: SparseVector | np.ndarray) -> Any:
    """A result moved to the current CuPy device (the form of a CuPy input)."""
    import cupy

    if isinstance(res, SparseVector):
        return SparseVector(cupy.asarray(res.indices), cupy.asarray(res.values), res.size,
                            check=False)
    return cupy.asarray(res)


class SparseOps:
    """The sparse allreduce entries of one communicator (module doc); lives on its loop."""

    def __init__(self, transport: Transport, next_id: Callable[[], int]) -> None:
        self._transport = transport
        self._next_id = next_id
        self._entries: dict[tuple[Any, ...], _Entry] = {}

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

    async def run(self, x: SparseVector | np.ndarray, *, algorithm: str,
                  quantize: int | None, delta: float | None, bucket: int, seed: int,
                  timeout: float | None) -> SparseVector | np.ndarray:
        """One sparse allreduce of host ``x`` with the cached entry of its key."""
        size, dt = (x.size, x.values.dtype) if isinstance(x, SparseVector) else (x.size, x.dtype)
        key = (int(size), np.dtype(dt).str, algorithm, quantize, delta, int(bucket), int(seed))
        entry = self._entries.get(key)
        if entry is None:
            # Built before taking an id (its executor is made at the first run): a bad
            # argument must not shift the ids.
            op = SparseAllreduce(self._transport, int(size), dt, sched_id=0,
                                 algorithm=algorithm, delta=delta, quantize=quantize,
                                 bucket=bucket, seed=seed)
            op.sched_id = self._next_id()
            entry = _Entry(op)
            self._entries[key] = entry
        async with entry.lock:
            try:
                return await entry.op.run(x, timeout=timeout)
            except BaseException:
                # A failed, timed-out or cancelled run leaves the executor mid-way: drop it.
                entry.op.close()
                if self._entries.get(key) is entry:
                    del self._entries[key]
                raise

    def close(self) -> None:
        """Stop every entry's executor (a waiting call fails with TransportClosedError)."""
        for e in self._entries.values():
            e.op.close()
        self._entries.clear()
