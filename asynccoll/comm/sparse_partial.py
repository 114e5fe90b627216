"""The persistent partial allreduce of sparse contributions (solo, majority, two-choice,
quorum): :class:`SparsePartialAllreduce`.

The call semantics are those of :class:`~asynccoll.PartialAllreduce` (``included``,
``contributors``, ``count``, ``missed``, ``accumulate``, ``flush``); only the data differs:

* a call contributes a :class:`~asynccoll.SparseVector` of the handle's size and dtype, or a
  dense NumPy array of that many entries (its nonzeros are the contribution);
* the send buffer is a stream buffer that holds the sum of the contributions not yet sent,
  sparse while it has at most ``delta`` entries and dense after: stale sparse data accumulates
  as dense data does, and is contributed by the next execution this rank takes part in;
* ``PartialResult.value`` is a SparseVector (sorted unique indices, no exact zeros) while the
  sum fits the sparse form and a dense 1-D NumPy array otherwise, by the rule of the chosen
  sparse algorithm (:mod:`asynccoll.collectives.sparse.schedules`); with ``accumulate=True`` the
  sum of the results not yet handed out, which may turn dense past ``delta``.

Schedule: :func:`~asynccoll.collectives.sparse.partial.build_sparse_partial_allreduce`.
Host memory only (NumPy); sum only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..buffers import is_cupy
from ..collectives.dense import scratch_buffers
from ..collectives.partial import COUNT
from ..collectives.sparse.partial import build_sparse_partial_allreduce, sparse_signature
from ..collectives.sparse.schedules import choose_algorithm, read_result
from ..collectives.sparse.streams import (
    SparseVector,
    add,
    add_into,
    dense_view,
    from_dense,
    read_stream,
    write_piece,
)
from ..errors import BusyError
from ..sched import Schedule
from .partial import Combine, PartialAllreduce

__all__ = ["SparsePartialAllreduce"]


class SparsePartialAllreduce(PartialAllreduce):
    """A :class:`~asynccoll.PartialAllreduce` whose data are sparse vectors (module doc).

    Made by :meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`
    when ``like`` is a :class:`~asynccoll.SparseVector`. ``algorithm``: a sparse algorithm
    (``ssar_recursive_double``, ``ssar_split_allgather``, ``dsar_split_allgather``) or
    ``None`` (chosen from ``density``, the expected per-rank fraction of nonzeros, and P, the
    same on every rank). ``delta``: the switch point to dense (default SparCML's). Raises
    ``ValueError`` naming ``op`` (only ``sum``), ``density``, ``delta`` or ``algorithm``,
    ``TypeError`` for CuPy values. Costs per call O(nnz) to merge the contribution while the
    send buffer is sparse (O(N) once dense), and per execution a copy of the buffer's bytes in
    use plus the sparse allreduce and a small dense allreduce of the meta vector.
    """

    def __init__(self, *args: Any, density: float | None = None, delta: float | None = None,
                 **kw: Any) -> None:
        if kw.get("op", "sum") != "sum":
            raise ValueError(f"op must be 'sum' for sparse contributions, got {kw['op']!r}")
        if delta is not None and (math.isnan(delta) or delta < 0):
            raise ValueError(f"delta must be >= 0 (math.inf: never dense), got {delta!r}")
        self._density = density
        self._delta_arg = delta
        super().__init__(*args, **kw)

    def _setup(self, like: Any, algorithm: str | None) -> tuple[Schedule, dict[str, Any]]:
        if not isinstance(like, SparseVector):
            raise TypeError(f"like must be a SparseVector, got {type(like).__name__}")
        if is_cupy(like.values):
            raise TypeError("like must hold NumPy arrays: sparse partial collectives run in "
                            "host memory")
        size, dt = like.size, np.dtype(like.values.dtype)
        self.shape = (size,)
        self.dtype = dt
        P = self.world_size
        if algorithm is None:
            algorithm = choose_algorithm(self._density, P, size, dt, self._delta_arg)
        elif self._density is not None:
            choose_algorithm(self._density, P, size, dt, self._delta_arg)  # validates density
        sched = build_sparse_partial_allreduce(self.rank, P, size, dt, kind=self.kind,
                                               quorum=self.quorum, algorithm=algorithm,
                                               delta=self._delta_arg)
        self.algorithm: str = algorithm
        self.delta: float = float(sched.meta["delta"])
        bufs: dict[str, Any] = {name: np.zeros(spec.count or 0, np.dtype(spec.dtype or "u1"))
                                for name, spec in sched.slots.items()}
        bufs.update(scratch_buffers(sched))
        self._acc = bufs["acc"]  # zeros: the empty sparse stream
        self._meta = bufs["meta"]
        self._state = bufs["state"]
        self._result = bufs[sched.meta["result"]]
        self._packed = False
        self._sig = sparse_signature(self.kind, self.quorum, size, dt, algorithm, self.delta)
        return sched, bufs

    def __repr__(self) -> str:
        return (f"SparsePartialAllreduce({self.kind!r}, name={self.name!r}, size="
                f"{self.shape[0]}, dtype={self.dtype}, algorithm={self.algorithm!r}, "
                f"rank={self.rank}/{self.world_size})")

    # -- on the loop -------------------------------------------------------------------------
    def _check(self, x: Any) -> Any:
        self._check_open()
        n = self.shape[0]
        if isinstance(x, SparseVector):
            if x.size != n or x.values.dtype != self.dtype:
                raise ValueError(f"x must be a SparseVector of size {n} and dtype {self.dtype} "
                                 f"like the handle, got size {x.size} and dtype "
                                 f"{x.values.dtype}")
            if is_cupy(x.values):
                raise TypeError("x must hold NumPy arrays (sparse partial collectives run in "
                                "host memory)")
        elif isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ValueError(f"x must be C-contiguous (got strides {x.strides})")
            if x.size != n or x.dtype != self.dtype:
                raise ValueError(f"x must be a SparseVector, or an array of {n} entries of "
                                 f"{self.dtype}, got {x.size} entries of {x.dtype}")
            x = x.reshape(-1)
        else:
            raise TypeError(f"x must be a SparseVector or a NumPy array, got "
                            f"{type(x).__name__}")
        if self._busy:
            raise BusyError(f"partial allreduce {self.name!r} already has a call or flush "
                            "under way; one at a time per handle")
        return x

    def _add(self, flat: Any, combine: Combine | None = None, late: bool = False) -> None:
        if combine is not None:
            raise ValueError("combine is not supported by sparse partial allreduces")
        n, dt, buf = self.shape[0], self.dtype, self._acc
        cur = read_stream(buf, n, dt)  # views of the send buffer
        x: SparseVector | np.ndarray = flat
        if isinstance(x, np.ndarray) and isinstance(cur, SparseVector):
            nz = int(np.count_nonzero(x))
            if cur.nnz + nz <= self.delta:
                x = from_dense(x)
        if isinstance(cur, np.ndarray):
            if isinstance(x, SparseVector):
                cur[x.indices] += x.values  # indices are unique
            else:
                cur += x
        elif isinstance(x, SparseVector):
            # new arrays (a stable merge of two sorted runs), so writing them back is safe
            write_piece(buf, add(cur, x, self.delta))
        else:
            d = x.copy()
            d[cur.indices] += cur.values
            dense_view(buf, n, dt)[:] = d
        self._state[COUNT] += 1

    def _keep(self) -> None:
        res = read_result(self._result, self.shape[0], self.dtype)  # views: copy or merge
        if self._value is None or not self.accumulate:
            self._value = res.copy() if isinstance(res, np.ndarray) else SparseVector(
                res.indices.copy(), res.values.copy(), res.size, check=False)
            self._vmeta[...] = self._meta
            return
        self._value = add_into(self._value, res, self.delta, res.dtype)
        self._vmeta += self._meta

    def _present(self, value: Any) -> Any:
        return value.without_zeros() if isinstance(value, SparseVector) else value
