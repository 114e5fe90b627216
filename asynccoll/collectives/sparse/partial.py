"""Partial allreduce of sparse contributions: the schedule of :mod:`.partial` around a sparse
allreduce (:mod:`.sparse_sched`).

One rank's persistent schedule::

    activation front (as in .partial) ─> snapshot ─┬─> sparse allreduce (prefix "sp_") ─┬─> final
                                                   └─> sum-allreduce of meta (int64) ───┘

* The send buffer ``acc`` is a *stream buffer* (:mod:`.sparse`): the runtime merges each call's
  contribution into it (sparse while the sum has at most ``delta`` entries, dense after), so
  stale sparse data accumulates as dense data does in the dense partial allreduce.
* The snapshot (kernel ``partial_sparse_snapshot``) copies the used part of ``acc`` (header and
  entries: O(nnz) bytes, the dense values once it went dense) into the sparse allreduce's input
  stream, resets ``acc`` to the empty sparse stream and writes ``meta`` exactly as the dense
  snapshot does (:func:`~.partial.write_meta`).
* Contributors, counts, fresh flags, the signature and the flushing count travel in a second,
  small dense allreduce of ``meta`` appended in the same schedule: sparse values cannot carry
  them exactly, and one more message of ``3P + 4`` int64 per rank is cheap next to the data.

Sum only (a sparse stream's absent entries are zeros).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...buffers import dtype_to_wire
from ...sched import BufRef, Schedule, SlotSpec
from ..dense import build_allreduce
from ..partial import (
    SHM_ATTACH,
    STATE_LEN,
    TAG_DATA,
    append_activation_front,
    check_kind,
    meta_len,
    signature,
    write_meta,
)
from .kernels import SPARSE_KERNELS
from .schedules import ALGORITHMS, append_sparse_allreduce, sparse_tags
from .shm import SHM_SPARSE_ALGORITHMS, append_sparse_shm_allreduce, shm_layout
from .streams import default_delta, index_dtype, stream_capacity

__all__ = ["PREFIX", "SPARSE_PARTIAL_KERNELS", "build_sparse_partial_allreduce",
           "sparse_signature", "stream_nbytes"]

#: the prefix of the sparse allreduce's slots in the schedule
PREFIX = "sp_"

_HDR = 16  # a stream buffer's header: int64 flag (0 sparse, 1 dense), int64 count


def sparse_signature(kind: str, quorum: int | None, size: int, dtype: Any, algorithm: str,
                     delta: float, shm: bool = False) -> int:
    """:func:`~.partial.signature` of a sparse partial allreduce (never equal to a dense one's
    of the same name by design: the algorithm field says ``sparse``; nor to its network
    form's when ``shm``, as the dense handles' names their path)."""
    return signature(kind, "sum", quorum, size, dtype,
                     f"sparse:{algorithm}:{delta!r}" + (":shm" if shm else ""))


def stream_nbytes(buf: np.ndarray, size: int, dtype: Any) -> int:
    """The bytes of stream buffer ``buf`` in use: header plus entries (or dense values)."""
    flag, n = (int(v) for v in buf[:_HDR].view(np.int64))
    isize = np.dtype(dtype).itemsize
    return int(_HDR + n * (isize if flag else index_dtype(size).itemsize + isize))


def build_sparse_partial_allreduce(rank: int, world_size: int, size: int, dtype: Any, *,
                                   kind: str = "solo", quorum: int | None = None,
                                   algorithm: str = "ssar_split_allgather",
                                   delta: float | None = None, shm: bool = False) -> Schedule:
    """The committed persistent schedule of one rank of a sparse partial allreduce (module doc).

    Slots to bind: ``acc`` (the send buffer: a stream buffer of ``meta["capacity"]`` bytes,
    holding the empty sparse stream at first), ``meta`` (:func:`~.partial.meta_len` int64),
    ``state`` (:data:`~.partial.STATE_LEN` int64, zeros), the sparse allreduce's slots (named
    ``sp_*``; ``meta["result"]`` names the one holding the result, read it with
    :func:`~.sparse_sched.read_result`) and the meta allreduce's scratch slots
    (:func:`~.dense.scratch_buffers`). ``shm``: the data phase through shared memory
    (:func:`~.shm.append_sparse_shm_allreduce`, the split algorithms only: every rank on one
    host), its segments in slots ``mine`` and ``peer{q}`` (bound by the handle, which maps the
    peers' in the kernel :data:`~.partial.SHM_ATTACH`), the result in ``sp_res`` or
    ``sp_out``. Raises ``ValueError`` naming a bad ``kind``, ``quorum``, ``algorithm``,
    ``size`` or ``delta``, ``TypeError`` for a dtype that is not float or integer.
    """
    k = check_kind(kind, world_size, quorum)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    dt = np.dtype(dtype)
    s = Schedule(rank, world_size,
                 name=f"sparse_partial_allreduce.{kind}" + (".shm" if shm else ""))
    m = meta_len(world_size)
    d = float(default_delta(size, dt) if delta is None else delta)
    cap = stream_capacity(size, dt, d)
    s.declare("acc", SlotSpec(cap, "|u1"))
    s.declare("meta", SlotSpec(m, "<i8"))
    s.declare("state", SlotSpec(STATE_LEN, "<i8"))
    activated = append_activation_front(s, k)
    sig = sparse_signature(kind, quorum, size, dt, algorithm, d, shm)
    snap_args: dict[str, Any] = {"label": "snapshot", "rank": rank, "world_size": world_size,
                                 "sig": sig, "n": int(size), "dtype": dtype_to_wire(dt)}
    if shm:
        if algorithm not in SHM_SPARSE_ALGORITHMS:
            raise ValueError(f"shm: the sparse data phase goes through shared memory for "
                             f"{SHM_SPARSE_ALGORITHMS} only, got algorithm {algorithm!r}")
        dense = algorithm == "dsar_split_allgather"
        segs = ["mine" if q == rank else f"peer{q}" for q in range(world_size)]
        in_cap, blk_cap, _ = shm_layout(int(size), dt, delta, world_size)
        for slot in segs:
            s.declare(slot, SlotSpec(in_cap + blk_cap, "|u1"))
        snap = s.compute("partial_sparse_snapshot", ["acc", BufRef("mine", 0, in_cap), "meta",
                                                     "state"], deps=activated, **snap_args)
        done, _inp, res = append_sparse_shm_allreduce(
            s, size, dt, delta=delta, dense=dense, segments=segs,
            result=PREFIX + ("out" if dense else "res"), after=[snap], tag_base=TAG_DATA,
            attach=SHM_ATTACH)
        ntags = 2
    else:
        # The sparse allreduce's input slot is named by the builder; the snapshot must exist
        # first (the allreduce's first ops wait for it), so it names the slot the builder will
        # declare, and the name is checked right after.
        inp_slot = PREFIX + ("s0" if algorithm == "ssar_recursive_double" else "in")
        snap = s.compute("partial_sparse_snapshot", ["acc", inp_slot, "meta", "state"],
                         deps=activated, **snap_args)
        done, src, res = append_sparse_allreduce(s, size, dt, algorithm=algorithm, delta=delta,
                                                 prefix=PREFIX, tag_base=TAG_DATA, after=[snap])
        if src != inp_slot:  # pragma: no cover - guards against a change of the sparse builder
            raise AssertionError(f"sparse allreduce input slot is {src!r}, expected {inp_slot!r}")
        ntags = sparse_tags(world_size)
    meta_done = build_allreduce(s, m, np.int64, "sum", None, slot="meta",
                                scratch_prefix="meta_", tag_base=TAG_DATA + ntags, after=[snap])
    s.final = s.nop(deps=[done, meta_done], label="final")
    s.meta["partial"] = {"kind": kind, "op": "sum", "quorum": k, "count": int(size),
                         "dtype": dtype_to_wire(dt), "packed": False, "sparse": True,
                         **({"shm": algorithm} if shm else {})}
    s.meta.update(result=res, capacity=cap, algorithm=algorithm, delta=d)
    return s.commit([*SPARSE_PARTIAL_KERNELS, SHM_ATTACH] if shm else SPARSE_PARTIAL_KERNELS)


def _snapshot(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
              msgs: Sequence[Any]) -> None:
    """Move the send stream into the allreduce's input stream and reset it; write ``meta``.

    No output, so the executor never offloads it: it must not race the runtime, which merges
    calls' data into ``acc`` on the loop. Cost: a copy of the bytes in use (O(nnz) sparse).
    """
    acc, inp, meta, state = inputs
    nb = stream_nbytes(acc, int(params["n"]), params["dtype"])
    inp[:nb] = acc[:nb]
    acc[:_HDR].view(np.int64)[:] = 0  # the empty sparse stream
    write_meta(meta, state, params)


#: the kernels a sparse partial allreduce schedule names: the sparse allreduce's
#: (:data:`~.kernels.SPARSE_KERNELS`, built-ins included) and ``partial_sparse_snapshot``
SPARSE_PARTIAL_KERNELS = SPARSE_KERNELS.extended({"partial_sparse_snapshot": _snapshot}).freeze()
