"""What a rank puts into a partial allreduce: the handle's contribution strategy, dense or sparse.

A :class:`~asynccoll.PartialAllreduce` (:mod:`.partial`) owns the call rules, the state and
meta vectors and the executor; it holds one :class:`Contribution`, which owns the data: it
builds the schedule and its buffers for ``like``, checks a call's data and adds it to the send
buffer, brings the meta vector up to date when an execution completes, and keeps and presents
the results. :meth:`Communicator.partial_allreduce
<asynccoll.Communicator.partial_allreduce>` picks :class:`SparseContribution` when ``like`` is
a :class:`~asynccoll.SparseVector`, else :class:`DenseContribution`.

Everything here runs on the runtime's loop, inside the handle's methods, atomically with
respect to snapshots.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..buffers import check_array, empty_like, is_cupy, reduce_into
from ..collectives.dense import scratch_buffers
from ..collectives.partial import (
    STATE_LEN,
    build_partial_allreduce,
    identity,
    meta_len,
    packs_meta,
    signature,
)
from ..collectives.shm import SHM_NAMES, build_shm_partial_allreduce, shm_algorithm
from ..collectives.sparse.partial import (
    build_sparse_partial_allreduce,
    sparse_signature,
    stream_nbytes,
)
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
from ..sched import Schedule

__all__ = ["Combine", "Contribution", "DenseContribution", "SparseContribution"]

#: ``combine(acc, x, n, late) -> n'``: see :meth:`PartialAllreduce.__call__
#: <asynccoll.PartialAllreduce.__call__>`.
Combine = Callable[[Any, Any, int, bool], int]


class Contribution(abc.ABC):
    """The data side of a partial allreduce handle (module doc).

    :meth:`build` comes first and sets :attr:`shape`, :attr:`dtype`, :attr:`algorithm` and
    :attr:`signature`; the other methods are called by the handle afterwards.
    """

    #: the class name the handle's repr shows
    label: ClassVar[str]
    op: str
    algorithm: str | None
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    #: what every rank's snapshot writes for this handle; the sum over P ranks checks agreement
    signature: int
    _acc: Any
    #: how many sets of segments executions alternate between (:class:`~.shm.PartialSegments`)
    segment_sets: ClassVar[int] = 2

    @property
    def shm(self) -> bool:
        """Whether the data phase goes through shared memory (the handle then makes the
        segments, :attr:`segment_sets` of them)."""
        return False

    @property
    def send_buffer(self) -> Any:
        """The flat send buffer (calls' data waiting for an execution; :meth:`build` made
        it)."""
        return self._acc

    # -- what a handle that outlives a lost rank asks (:mod:`.survival`) ---------------------
    @abc.abstractmethod
    def snapshot_of(self, inputs: Any, params: Any) -> Any:
        """After the snapshot kernel ran on ``inputs`` (with ``params``): a view of what it
        moved into the execution (to keep a copy of; the count is in ``meta``)."""

    @abc.abstractmethod
    def result_buffers(self) -> tuple[Any, Any]:
        """Where an execution's result lands: the data buffer and the int64 meta vector."""

    @abc.abstractmethod
    def put_back(self, snapshot: Any) -> None:
        """Add ``snapshot`` (a copy of :meth:`snapshot_of`, an execution nobody completed)
        back into the send buffer."""

    @abc.abstractmethod
    def carry(self, old: Any, new: Any) -> None:
        """Copy the send buffer ``old`` into ``new``, the send buffer of a rebuilt schedule."""

    @abc.abstractmethod
    def go_network(self) -> None:
        """From the next :meth:`build` on, the data phase goes over the network (a handle
        whose segments could not be had on some rank, or that survived a lost rank)."""

    @abc.abstractmethod
    def build(self, like: Any, rank: int, world_size: int, kind: str,
              quorum: int | None, keep: Any = None) -> tuple[Schedule, dict[str, Any]]:
        """The committed schedule of ``rank`` for data like ``like`` and its buffers, the send
        buffer ``acc``, ``meta`` (int64) and ``state`` (``STATE_LEN`` int64) among them.
        ``keep``: the send buffer of the schedule this one replaces, which the new schedule
        may take over as it is (``bufs["acc"] is keep``: nothing to :meth:`carry`).
        Raises ``ValueError``/``TypeError`` naming ``like`` or ``algorithm``."""

    @abc.abstractmethod
    def check(self, x: Any) -> Any:
        """A call's data ``x`` as :meth:`add` takes it; ``ValueError``/``TypeError`` naming
        ``x`` when it does not fit."""

    @abc.abstractmethod
    def add(self, x: Any, count: int, combine: Combine | None, late: bool) -> int:
        """Add checked data to the send buffer, which holds ``count`` contributions; return
        how many it holds now (``combine`` and ``late``: see the handle's ``__call__``)."""

    @abc.abstractmethod
    def unpack_meta(self) -> None:
        """Bring ``meta`` up to date after an execution completed."""

    @abc.abstractmethod
    def keep(self, kept: Any, accumulate: bool, divisor: int = 1) -> Any:
        """The result just completed, as a value of its own (the next snapshot overwrites the
        result buffer): a copy, or with ``accumulate`` the sum with ``kept`` (``None``:
        nothing kept), the result divided by ``divisor`` first (per-execution averaging;
        dense floating-point data only: a true division in the data's dtype, as
        ``torch.distributed``'s averaging does, not a multiplication by its reciprocal, which
        rounds twice). May reuse ``kept``, which has never been handed out."""

    @abc.abstractmethod
    def merge(self, kept: Any, other: Any) -> Any:
        """``kept`` and ``other`` (two kept values, results the caller never received) reduced
        into one, as ``keep`` with ``accumulate`` would have; may reuse ``kept``."""

    def present(self, value: Any) -> Any:
        """A kept value as a result's ``value``."""
        return value

    def check_out(self, out: Any) -> Any:
        """A call's ``out=`` array as a flat view to copy a result into; ``ValueError`` /
        ``TypeError`` naming ``out`` when it does not fit (only dense handles take one)."""
        raise TypeError(f"out= needs a dense handle ({self.label} results are not arrays of "
                        "a fixed shape)")

    def recycle(self, value: Any) -> None:
        """Take back a kept value that was copied into a call's ``out`` and handed out no
        other way: the next :meth:`keep` may write into it instead of allocating (here: not
        reused)."""
        return None

    @abc.abstractmethod
    def describe(self) -> str:
        """The data's part of the handle's repr."""


class DenseContribution(Contribution):
    """Arrays of ``like``'s shape and dtype (NumPy or CuPy), reduced with ``op``.

    Schedule: :func:`~asynccoll.collectives.partial.build_partial_allreduce` (the meta vector
    packed after the data where the dtype carries it exactly), or with ``algorithm`` one of
    :data:`~asynccoll.collectives.shm.SHM_NAMES` the data phase through shared memory
    (:func:`~asynccoll.collectives.shm.build_shm_partial_allreduce`: the handle binds the segments,
    :attr:`shm`). Costs per call one reduction into the send buffer (or ``combine``), per
    execution one copy of the result.
    """

    label = "PartialAllreduce"

    def __init__(self, op: str, algorithm: str | None = None) -> None:
        self.op = op
        self.algorithm = algorithm
        self._spare: Any = None  # a kept value handed back by recycle(), for the next keep

    def build(self, like: Any, rank: int, world_size: int, kind: str,
              quorum: int | None, keep: Any = None) -> tuple[Schedule, dict[str, Any]]:
        self.shape = tuple(like.shape)
        self.dtype = np.dtype(like.dtype)
        count = int(like.size)
        P, op = world_size, self.op
        if self.shm:
            sched = build_shm_partial_allreduce(rank, P, count, self.dtype, kind=kind, op=op,
                                                quorum=quorum,
                                                algorithm=shm_algorithm(self.algorithm))
        else:
            sched = build_partial_allreduce(rank, P, count, self.dtype, kind=kind, op=op,
                                            quorum=quorum, algorithm=self.algorithm)
        flat_like = like.reshape(-1)
        if keep is not None and keep.shape == flat_like.shape and keep.dtype == self.dtype \
                and is_cupy(keep) == is_cupy(flat_like):
            # a rebuilt schedule's (a lost rank, a rank taken in) keeps the send buffer, what
            # it holds and all: only the snapshot kernel touches it, never the transport; a new
            # one filled with the identity would cost a pass over the pages, the carry another
            self._acc = keep
        else:
            self._acc = empty_like(flat_like)
            self._acc.fill(identity(op, self.dtype))
        self._packed = packs_meta(self.dtype, op, P)
        m = meta_len(P)
        self._work = empty_like(flat_like, count + (m if self._packed else 0))
        self._data = self._work[:count]  # the result part of the work buffer
        self._meta = np.zeros(m, np.int64)
        self.signature = signature(kind, op, quorum, count, self.dtype,
                                   f"shm_{sched.meta['partial']['shm']}" if self.shm
                                   else self.algorithm)
        state = np.zeros(STATE_LEN, np.int64)
        bufs = {"acc": self._acc, "data": self._work, "meta": self._meta, "state": state}
        bufs.update(scratch_buffers(sched))
        if is_cupy(flat_like):  # the data's scratch on the device, meta's on the host
            bufs.update({k: v for k, v in scratch_buffers(sched, flat_like).items()
                         if not k.startswith("meta_")})
        return sched, bufs

    @property
    def shm(self) -> bool:
        """Whether the data phase goes through shared memory (every rank on one host)."""
        return self.algorithm in SHM_NAMES

    def go_network(self) -> None:
        """From the next :meth:`build` on, the data phase goes over the network (a handle
        that survived a lost rank rebuilds so)."""
        if self.shm:
            self.algorithm = None

    def snapshot_of(self, inputs: Any, params: Any) -> Any:
        return inputs[1][:params["count"]]  # (acc, data, meta, state): data

    def result_buffers(self) -> tuple[Any, Any]:
        return self._work, self._meta

    def put_back(self, snapshot: Any) -> None:
        reduce_into(self.op, self._acc, snapshot)

    def carry(self, old: Any, new: Any) -> None:
        new[...] = old

    @property
    def work(self) -> Any:
        """The work buffer: an execution's result (and the packed meta vector, if packed)."""
        return self._work

    def check(self, x: Any) -> Any:
        check_array(x, "x")
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"x must have shape {self.shape} and dtype {self.dtype} like the "
                             f"handle, got shape {tuple(x.shape)} and dtype {x.dtype}")
        return x.reshape(-1)

    def add(self, x: Any, count: int, combine: Combine | None, late: bool) -> int:
        if is_cupy(self._acc) and not is_cupy(x):
            raise TypeError("x must be a CuPy array like the handle's")
        if combine is None:
            if count == 0:  # the send buffer holds the identity: x itself, one pass not two
                self._acc[...] = x
            else:
                reduce_into(self.op, self._acc, x)
            return count + 1
        return int(combine(self._acc, x, count, late))

    def unpack_meta(self) -> None:
        if self._packed:
            tail = self._work[self._data.size:]
            tail = tail.get() if is_cupy(tail) else tail
            np.copyto(self._meta, np.rint(tail.real), casting="unsafe")

    def check_out(self, out: Any) -> Any:
        check_array(out, "out", writable=True)
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise ValueError(f"out must have shape {self.shape} and dtype {self.dtype} like the "
                             f"handle, got shape {tuple(out.shape)} and dtype {out.dtype}")
        if is_cupy(out) != is_cupy(self._data):
            raise TypeError("out must be a " + ("CuPy" if is_cupy(self._data) else "NumPy")
                            + " array like the handle's")
        return out.reshape(-1)

    def recycle(self, value: Any) -> None:
        self._spare = value

    def keep(self, kept: Any, accumulate: bool, divisor: int = 1) -> Any:
        if divisor != 1:
            self._data /= divisor  # in place: the next snapshot overwrites the result buffer
        if kept is None:
            # A fresh array per result costs its page faults (at 16 MiB 25-30 ms on the
            # development machine, against about 1 ms to copy into memory already touched):
            # a value a call copied into its ``out=`` comes back here (``recycle``) instead.
            spare, self._spare = self._spare, None
            if spare is not None:
                spare[...] = self._data
                return spare
            return self._data.copy()
        if accumulate:
            reduce_into(self.op, kept, self._data)
        else:
            kept[...] = self._data
        return kept

    def merge(self, kept: Any, other: Any) -> Any:
        reduce_into(self.op, kept, other)
        return kept

    def present(self, value: Any) -> Any:
        return value.reshape(self.shape)

    def describe(self) -> str:
        return f"shape={self.shape}, dtype={self.dtype}, op={self.op!r}"


class SparseContribution(Contribution):
    """Sparse vectors: :class:`~asynccoll.SparseVector` of ``like``'s size and dtype, or dense
    NumPy arrays of that many entries (their nonzeros are the contribution); sum only.

    * The send buffer is a stream buffer that holds the sum of the contributions not yet
      sent, sparse while it has at most ``delta`` entries and dense after: stale sparse data
      accumulates as dense data does, and goes into the next execution this rank takes part
      in.
    * A result's ``value`` is a SparseVector (sorted unique indices, no exact zeros) while the
      sum fits the sparse form and a dense 1-D NumPy array otherwise, by the rule of the sparse
      algorithm (:mod:`asynccoll.collectives.sparse.schedules`); with ``accumulate=True`` the
      sum of the results not yet handed out, which may turn dense past ``delta``.

    ``algorithm``: ``ssar_recursive_double``, ``ssar_split_allgather``,
    ``dsar_split_allgather`` or ``None`` (chosen from ``density``, the expected per-rank
    fraction of nonzeros, and P: the same on every rank). ``delta``: the switch point to dense
    (default SparCML's). Schedule:
    :func:`~asynccoll.collectives.sparse.partial.build_sparse_partial_allreduce`. Host memory
    only. Raises ``ValueError`` naming ``op`` (only ``sum``), ``density``, ``delta`` or
    ``algorithm``, ``TypeError`` for CuPy values. Costs per call O(nnz) to merge the
    contribution while the send buffer is sparse (O(N) once dense), and per execution a copy
    of the buffer's bytes in use plus the sparse allreduce and a small dense allreduce of the
    meta vector.
    """

    label = "SparsePartialAllreduce"
    #: one set: the split allgather's two wake-up rounds make reuse safe
    #: (:mod:`asynccoll.collectives.sparse.shm`, "Reuse")
    segment_sets = 1

    def __init__(self, op: str = "sum", algorithm: str | None = None, *,
                 density: float | None = None, delta: float | None = None,
                 shm: bool = False) -> None:
        if op != "sum":
            raise ValueError(f"op must be 'sum' for sparse contributions, got {op!r}")
        if delta is not None and (math.isnan(delta) or delta < 0):
            raise ValueError(f"delta must be >= 0 (math.inf: never dense), got {delta!r}")
        self.op = op
        self.algorithm = algorithm
        self._density = density
        self._delta_arg = delta
        self._shm = bool(shm)  # the split algorithms, every rank on one host

    @property
    def shm(self) -> bool:
        return self._shm

    def go_network(self) -> None:
        self._shm = False

    def snapshot_of(self, inputs: Any, params: Any) -> Any:
        inp = inputs[1]  # (acc, input stream, meta, state): the stream's bytes in use
        return inp[:stream_nbytes(inp, self.shape[0], self.dtype)]

    def result_buffers(self) -> tuple[Any, Any]:
        return self._result, self._meta

    def put_back(self, snapshot: Any) -> None:
        x = read_stream(snapshot, self.shape[0], self.dtype)
        self.add(x if isinstance(x, np.ndarray) else SparseVector(
            x.indices.copy(), x.values.copy(), x.size, check=False), 0, None, True)

    def carry(self, old: Any, new: Any) -> None:
        nb = stream_nbytes(old, self.shape[0], self.dtype)
        new[:nb] = old[:nb]

    def build(self, like: Any, rank: int, world_size: int, kind: str,
              quorum: int | None, keep: Any = None) -> tuple[Schedule, dict[str, Any]]:
        if not isinstance(like, SparseVector):
            raise TypeError(f"like must be a SparseVector, got {type(like).__name__}")
        if is_cupy(like.values):
            raise TypeError("like must hold NumPy arrays: sparse partial collectives run in "
                            "host memory")
        size, dt = like.size, np.dtype(like.values.dtype)
        self.shape = (size,)
        self.dtype = dt
        P = world_size
        algorithm = self.algorithm
        if algorithm is None:
            algorithm = choose_algorithm(self._density, P, size, dt, self._delta_arg)
        elif self._density is not None:
            choose_algorithm(self._density, P, size, dt, self._delta_arg)  # validates density
        sched = build_sparse_partial_allreduce(rank, P, size, dt, kind=kind, quorum=quorum,
                                               algorithm=algorithm, delta=self._delta_arg,
                                               shm=self.shm)
        self.algorithm = algorithm
        self.delta = float(sched.meta["delta"])
        bufs: dict[str, Any] = {name: np.zeros(spec.count or 0, np.dtype(spec.dtype or "u1"))
                                for name, spec in sched.slots.items()}
        bufs.update(scratch_buffers(sched))
        self._acc = bufs["acc"]  # zeros: the empty sparse stream
        self._result = bufs[sched.meta["result"]]
        self._meta = bufs["meta"]
        self.signature = sparse_signature(kind, quorum, size, dt, algorithm, self.delta,
                                          self.shm)
        return sched, bufs

    def unpack_meta(self) -> None:
        pass  # the meta vector has an allreduce of its own, straight into ``meta``

    def check(self, x: Any) -> Any:
        n = self.shape[0]
        if isinstance(x, SparseVector):
            if x.size != n or x.values.dtype != self.dtype:
                raise ValueError(f"x must be a SparseVector of size {n} and dtype {self.dtype} "
                                 f"like the handle, got size {x.size} and dtype "
                                 f"{x.values.dtype}")
            if is_cupy(x.values):
                raise TypeError("x must hold NumPy arrays (sparse partial collectives run in "
                                "host memory)")
            return x
        if isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ValueError(f"x must be C-contiguous (got strides {x.strides})")
            if x.size != n or x.dtype != self.dtype:
                raise ValueError(f"x must be a SparseVector, or an array of {n} entries of "
                                 f"{self.dtype}, got {x.size} entries of {x.dtype}")
            return x.reshape(-1)
        raise TypeError(f"x must be a SparseVector or a NumPy array, got {type(x).__name__}")

    def add(self, x: Any, count: int, combine: Combine | None, late: bool) -> int:
        if combine is not None:
            raise ValueError("combine is not supported by sparse partial allreduces")
        n, dt, buf = self.shape[0], self.dtype, self._acc
        cur = read_stream(buf, n, dt)  # views of the send buffer
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
        return count + 1

    def keep(self, kept: Any, accumulate: bool, divisor: int = 1) -> Any:
        if divisor != 1:
            raise ValueError("per-execution averaging needs dense contributions")
        res = read_result(self._result, self.shape[0], self.dtype)  # views: copy or merge
        if kept is None or not accumulate:
            return res.copy() if isinstance(res, np.ndarray) else SparseVector(
                res.indices.copy(), res.values.copy(), res.size, check=False)
        return add_into(kept, res, self.delta, res.dtype)

    def merge(self, kept: Any, other: Any) -> Any:
        return add_into(kept, other, self.delta, self.dtype)

    def present(self, value: Any) -> Any:
        return value.without_zeros() if isinstance(value, SparseVector) else value

    def describe(self) -> str:
        return f"size={self.shape[0]}, dtype={self.dtype}, algorithm={self.algorithm!r}"
