"""Sparse allreduce schedules (SparCML §5.3): builders, the algorithm choice, stream I/O.

Three algorithms, for every world size P >= 1:

* ``ssar_recursive_double``: log2(P') stages of pairwise exchange-and-merge among the largest
  power of two P' <= P ranks; each of the P - P' extra ranks first folds its vector into a
  partner and gets the result back at the end. Latency-optimal; best when the result is small.
* ``ssar_split_allgather``: split the index space into P ranges; send each range's piece to its
  owner (sparse, or dense where denser than the switch point), which sums them; then every rank
  sends its reduced range to every other (a concatenating allgather). Bandwidth-balanced.
* ``dsar_split_allgather``: the same split phase, then the reduced ranges are dense and are
  gathered densely, received straight into the result array; optionally QSGD-quantised
  (``quantize=bits``), in which case every rank, owner included, keeps the decoded values.

**Where the partial sums live.** A schedule keeps each partial sum in a bound *stream buffer*
(see :mod:`.sparse`): a byte slot sized like the dense vector, which holds the sum sparse or
dense. Kernels (``sparse.*``) read their input streams from slots and received frames from
messages and write their result into their output slot, returning it as the payload of the
next send, so nothing is copied to be sent and the schedule stays plain data (params are JSON).
Ping-pong slots and dependencies on the previous send keep a buffer from being overwritten
while it is on the wire.

**Which algorithm.** :func:`choose_algorithm` picks from the caller's expected per-rank density
and P (the choice must agree on every rank, so it never looks at the local data):
DSAR when the expected union of P random index sets passes the switch point, else recursive
doubling when the expected data of all ranks is small (latency-bound) or P <= 2, else the split
allgather. Without a density, the split allgather (sound across the whole range).

**What comes back.** A :class:`~.sparse.SparseVector` (sorted unique indices; exact zeros, e.g.
from cancellation, dropped) while the sum fits the sparse form, else a dense NumPy array: for
recursive doubling, sparse iff the union of the ranks' stored index sets has at most ``delta``
entries; for the split allgather, iff the sum has at most ``delta`` nonzeros; DSAR always
returns a dense array. Every rank gets the same type and bitwise the same values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...buffers import dtype_to_wire
from ...sched import Schedule, SlotSpec
from ...sched.schedule import BufRef
from . import quantize as qsgd
from .kernels import SPARSE_KERNELS, partition
from .streams import (
    SparseVector,
    default_delta,
    dense_view,
    from_dense,
    index_dtype,
    read_stream,
    stream_capacity,
    write_piece,
)

__all__ = ["ALGORITHMS", "append_sparse_allreduce", "build_sparse_allreduce", "choose_algorithm",
           "load_stream", "partition", "read_result", "sparse_tags"]

ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather")

#: below this many expected bytes from all ranks together, recursive doubling wins (latency)
RECURSIVE_DOUBLING_BYTES = 1 << 18

_TAG_FOLD, _TAG_UNFOLD, _TAG_SPLIT, _TAG_GATHER, _TAG_STAGE = 1, 2, 3, 4, 16


def choose_algorithm(density: float | None, world_size: int, size: int, dtype: Any = np.float32,
                     delta: float | None = None) -> str:
    """The algorithm for a per-rank ``density`` (fraction of nonzeros expected on every rank).

    Deterministic in its arguments, so ranks that pass the same ones agree.
    """
    if density is not None and not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be a fraction in 0..1, got {density!r}")
    if world_size == 1:
        return "ssar_recursive_double"
    if density is None:
        return "ssar_split_allgather"
    dt = np.dtype(dtype)
    if delta is None:
        delta = default_delta(size, dt)
    union = size * (1.0 - (1.0 - density) ** world_size)  # P uniform random index sets
    if union > delta:
        return "dsar_split_allgather"
    per_rank = density * size * (index_dtype(size).itemsize + dt.itemsize)
    if world_size <= 2 or per_rank * world_size <= RECURSIVE_DOUBLING_BYTES:
        return "ssar_recursive_double"
    return "ssar_split_allgather"


def _params(size: int, dtype: np.dtype[Any], delta: float) -> dict[str, Any]:
    return {"n": size, "dtype": dtype_to_wire(dtype),
            "delta": None if math.isinf(delta) else float(delta)}


def _check(algorithm: str, size: int, dtype: Any, delta: float | None,
           quantize: int | None) -> tuple[np.dtype[Any], float]:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    dt = np.dtype(dtype)
    if dt.kind not in "fiu":
        raise TypeError(f"dtype must be a float or integer dtype, got {dt}")
    if quantize is not None:
        qsgd.levels(quantize)
        if algorithm != "dsar_split_allgather":
            raise ValueError("quantize applies to the dense stage of dsar_split_allgather only; "
                             f"algorithm is {algorithm!r}")
        if dt.kind != "f":
            raise TypeError(f"quantize needs a float dtype, got {dt}")
    d = float(default_delta(size, dt) if delta is None else delta)
    if math.isnan(d) or d < 0:
        raise ValueError(f"delta must be >= 0 (math.inf: never switch to dense), got {delta!r}")
    return dt, d


def sparse_tags(world_size: int) -> int:
    """How many tags, from ``tag_base``, an appended sparse allreduce uses."""
    return _TAG_STAGE + max(1, world_size).bit_length()


def append_sparse_allreduce(s: Schedule, size: int, dtype: Any = np.float32, *,
                            algorithm: str = "ssar_split_allgather",
                            delta: float | None = None, quantize: int | None = None,
                            bucket: int = 512, prefix: str = "", tag_base: int = 0,
                            after: Sequence[int] = ()) -> tuple[int, str, str]:
    """Append a sparse allreduce to the uncommitted schedule ``s``; for composing it with other
    ops (a partial collective's activation and snapshot, say).

    Its ops that read the input wait for every op in ``after`` (AND); its receives are posted
    when the execution is armed. It declares its slots under ``prefix`` and uses tags
    ``tag_base .. tag_base + sparse_tags(P) - 1``. Returns ``(done, input_slot, result)``:
    the id of a no-op that completes when the result is in place and every send has completed,
    the stream slot to fill before ``after`` completes (:func:`load_stream`), and the slot that
    holds the result (read it with :func:`read_result`). Raises ``ValueError`` naming a bad
    argument.
    """
    dt, d = _check(algorithm, size, dtype, delta, quantize)
    cap = stream_capacity(size, dt, d)
    s.meta.setdefault("sparse", {})[prefix] = {
        "algorithm": algorithm, "size": int(size), "dtype": dtype_to_wire(dt),
        "delta": None if math.isinf(d) else d, "quantize": quantize, "capacity": cap}
    p = _params(int(size), dt, d)
    first = len(s.ops)
    ctx = _Ctx(s, p, cap, prefix, tag_base, tuple(after))
    if algorithm == "ssar_recursive_double":
        src, res = _recursive_double(ctx)
    else:
        src, res = _split_allgather(ctx, dense=algorithm == "dsar_split_allgather",
                                    bits=quantize, bucket=bucket)
    mine = range(first, len(s.ops))
    has_succ = {dep for i in mine for dep in s.ops[i].deps}
    done = s.nop(deps=[i for i in mine if i not in has_succ], label="sparse allreduce done")
    return done, src, res


def build_sparse_allreduce(rank: int, world_size: int, size: int, dtype: Any = np.float32, *,
                           algorithm: str = "ssar_split_allgather", delta: float | None = None,
                           quantize: int | None = None, bucket: int = 512) -> Schedule:
    """The committed schedule of ``rank`` for a sparse allreduce of length-``size`` vectors.

    Slots (all bound by the runtime, :class:`asynccoll.comm.sparse.SparseAllreduce`): stream
    buffers of bytes (``s0``/``s1``/``in``, ``stg``, ``blk``, ``res``), ``out`` (dense result,
    DSAR) and ``seed`` (one uint64 per execution, for quantisation). ``schedule.meta["input"]``
    and ``["result"]`` name the slots of the input stream and of the result. Raises
    ``ValueError`` naming a bad argument.
    """
    s = Schedule(rank, world_size, f"sparse_allreduce/{algorithm}")
    done, src, res = append_sparse_allreduce(s, size, dtype, algorithm=algorithm, delta=delta,
                                             quantize=quantize, bucket=bucket)
    s.meta.update(s.meta["sparse"][""], input=src, result=res)
    s.final = done
    return s.commit(SPARSE_KERNELS)


class _Ctx:
    """What the algorithm builders share: the schedule, kernel params, slot and tag naming."""

    def __init__(self, s: Schedule, p: dict[str, Any], cap: int, prefix: str, tag_base: int,
                 after: tuple[int, ...]) -> None:
        self.s, self.p, self.cap, self.pre, self.tb, self.after = s, p, cap, prefix, tag_base, \
            after

    def slot(self, name: str, spec: SlotSpec) -> str:
        self.s.declare(self.pre + name, spec)
        return self.pre + name

    def tag(self, t: int) -> int:
        return self.tb + t


def _recursive_double(c: _Ctx) -> tuple[str, str]:
    s, p = c.s, c.p
    r, world = s.rank, s.world_size
    s0 = c.slot("s0", SlotSpec(c.cap, "|u1"))
    s1 = c.slot("s1", SlotSpec(c.cap, "|u1"))
    p2 = 1 << (world.bit_length() - 1)
    extra = world - p2
    last = s.compute("sparse.emit", [s0], deps=c.after, label="own stream", **p)
    if r >= p2:  # fold into a partner, get the result back
        snd = s.send(r - p2, None, c.tag(_TAG_FOLD), deps=last, payload_from=last)
        rcv = s.recv(r - p2, None, c.tag(_TAG_UNFOLD))
        s.compute("sparse.store", (), s1, deps=(rcv, snd), recvs=(rcv,), label="result", **p)
        return s0, s1
    cur, other = s0, s1
    if r < extra:
        rcv = s.recv(r + p2, None, c.tag(_TAG_FOLD))
        last = s.compute("sparse.merge", [cur], other, deps=(rcv, last), recvs=(rcv,),
                         label="fold", **p)
        cur, other = other, cur
    dist, stage = 1, 0
    while dist < p2:
        peer = r ^ dist
        snd = s.send(peer, None, c.tag(_TAG_STAGE + stage), deps=last, payload_from=last)
        rcv = s.recv(peer, None, c.tag(_TAG_STAGE + stage))
        last = s.compute("sparse.merge", [cur], other, deps=(rcv, snd), recvs=(rcv,),
                         label=f"stage {stage}", **p)
        cur, other = other, cur
        dist, stage = dist * 2, stage + 1
    if r < extra:
        s.send(r + p2, None, c.tag(_TAG_UNFOLD), deps=last, payload_from=last)
    return s0, cur


def _split_allgather(c: _Ctx, *, dense: bool, bits: int | None, bucket: int
                     ) -> tuple[str, str]:
    s, p = c.s, c.p
    r, world, n = s.rank, s.world_size, p["n"]
    parts = partition(n, world)
    lo, hi = parts[r]
    dt = np.dtype(p["dtype"])
    src = c.slot("in", SlotSpec(c.cap, "|u1"))
    stg = c.slot("stg", SlotSpec(c.cap, "|u1"))
    others = [j for j in range(world) if j != r]
    for j in others:
        # the staging slot is an input, not the output: the executor sizes a kernel's work by
        # its output view, and a piece costs O(its entries), not O(the slot): run it inline
        pc = s.compute("sparse.piece", [src, stg], None, deps=c.after, label=f"piece for {j}",
                       lo=parts[j][0], hi=parts[j][1], **p)
        s.send(j, None, c.tag(_TAG_SPLIT), deps=pc, payload_from=pc)
    rcvs = [s.recv(j, None, c.tag(_TAG_SPLIT)) for j in others]
    rp = dict(p, lo=lo, hi=hi, pos=r)
    if not dense:
        blk = c.slot("blk", SlotSpec(stream_capacity(hi - lo, dt, math.inf), "|u1"))
        res = c.slot("res", SlotSpec(c.cap, "|u1"))
        red = s.compute("sparse.reduce", [src], blk, deps=(*rcvs, *c.after), recvs=rcvs,
                        label="reduce own range", **rp)
        for j in others:
            s.send(j, None, c.tag(_TAG_GATHER), deps=red, payload_from=red)
        gath = [s.recv(j, None, c.tag(_TAG_GATHER)) for j in others]
        s.compute("sparse.assemble", [blk], res, deps=(red, *gath), recvs=gath,
                  label="assemble", **rp)
        return src, res
    out = c.slot("out", SlotSpec(n, p["dtype"]))
    seed = c.slot("seed", SlotSpec(1, "<u8"))
    own = BufRef(out, lo, hi - lo)
    red = s.compute("sparse.reduce_dense", [src, seed], own, deps=(*rcvs, *c.after),
                    recvs=rcvs, label="reduce own range", bits=bits, bucket=bucket, **rp)
    for j in others:
        if bits is None:
            s.send(j, own, c.tag(_TAG_GATHER), deps=red)
        else:
            s.send(j, None, c.tag(_TAG_GATHER), deps=red, payload_from=red)
    for j in others:
        jl, jh = parts[j]
        if bits is None:
            s.recv(j, BufRef(out, jl, jh - jl), c.tag(_TAG_GATHER))
        else:
            rcv = s.recv(j, None, c.tag(_TAG_GATHER))
            s.compute("sparse.dequantize", (), BufRef(out, jl, jh - jl), deps=rcv,
                      recvs=(rcv,), label=f"decode range of {j}")
    return src, out


def load_stream(buf: np.ndarray, x: SparseVector | np.ndarray, size: int, dtype: Any,
                delta: float) -> None:
    """Write contribution ``x`` into input stream slot ``buf``: sparse while it has at most
    ``delta`` nonzeros, else dense. ``x`` must have ``size`` entries of ``dtype``."""
    if isinstance(x, SparseVector):
        if x.nnz > delta:
            x.to_dense(out=dense_view(buf, size, dtype))
        else:
            write_piece(buf, x)
        return
    nz = int(np.count_nonzero(x))
    if nz > delta:
        dense_view(buf, size, dtype)[:] = x
    else:
        write_piece(buf, from_dense(x))


def read_result(buf: np.ndarray, size: int, dtype: Any) -> SparseVector | np.ndarray:
    """The result held by a result slot: a SparseVector without exact zeros, or the dense
    array (the ``out`` slot of DSAR is returned as it is). Views of ``buf``, no copy."""
    if buf.dtype != np.uint8:
        return buf
    res = read_stream(buf, size, dtype)
    return res.without_zeros() if isinstance(res, SparseVector) else res
