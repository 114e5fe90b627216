"""The sparse split allgather between the ranks of one host, through shared memory.

Over the network the split allgather (:mod:`.schedules`) sends every rank's piece of range j to
rank j, and every reduced range to every rank: at P = 8, N = 16M and 0.78 % density, about 8
MiB out and 8 MiB in per rank through the kernel's TCP loopback, half of each rank's CPU per
call. On one host every rank can read its peers' streams where they are instead. Each rank owns
a segment (:mod:`asynccoll.comm.shm`'s, mapped read-only by the peers) of two regions:

* the **input** region: the rank's contribution as a stream (:func:`.load_stream`), written by
  the runtime before the execution starts;
* the **block** region: the rank's reduced range, as a stream (sparse, or dense past the
  range's switch point).

A call, for rank r of P:

1. r tells every peer its input is in (an empty message over the communicator's connections:
   the wake-up, no spinning);
2. once told by every peer, r reads range r out of every rank's input region (a binary search
   in a sparse stream, a slice of a dense one), in rank order, and sums it into its block
   region (:func:`~.kernels.reduce_block`, the network schedule's kernel: the same bits);
3. r tells every peer its block is in;
4. once told by every peer, r concatenates every rank's block region into its result
   (:func:`~.kernels.assemble`), a fresh buffer per call (results stay valid).

Two wake-up rounds, 2 (P - 1) empty messages per rank, and no data over the network. **Reuse**
needs no third round: r writes its input region again only after its call returned, that is
after every peer said its block was in (so had finished reading r's input); and its block
region only once every peer has said its next input is in, which a peer does only after its
own call returned (so had finished reading r's block).

**What a peer wrote is checked** before it is used: the stream's header (its form and its count
within the region), a dense piece's length, and that the indices read are sorted, unique and
inside the range. A bad one fails the execution naming the rank (the peers are processes of the
same user, so this guards against bugs, not attacks).

``dense=True`` gives the DSAR form: blocks are dense and the result is a dense array (without
quantisation, whose point is fewer bytes on a network).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...buffers import dtype_to_wire
from ...sched import BufRef, Schedule, SlotSpec
from .kernels import SPARSE_KERNELS, partition
from .streams import default_delta, index_dtype, stream_capacity

__all__ = ["SHM_SPARSE_ALGORITHMS", "append_sparse_shm_allreduce", "build_sparse_shm_allreduce",
           "shm_layout"]

#: the algorithms whose shared-memory form this module builds
SHM_SPARSE_ALGORITHMS = ("ssar_split_allgather", "dsar_split_allgather")

_TAG_IN, _TAG_REDUCED = 0, 1
_ALIGN = 64


def shm_layout(size: int, dtype: Any, delta: float | None, world_size: int
               ) -> tuple[int, int, float]:
    """``(input_bytes, block_bytes, delta)``: the two regions of every rank's segment (the
    input region rounded up to 64 bytes; the block region sized for the largest range, sparse
    with every entry present) and the switch point used."""
    dt = np.dtype(dtype)
    d = float(default_delta(size, dt) if delta is None else delta)
    in_cap = -(-stream_capacity(size, dt, d) // _ALIGN) * _ALIGN
    longest = max(hi - lo for lo, hi in partition(size, world_size))
    blk_cap = 16 + longest * (index_dtype(size).itemsize + dt.itemsize)
    return in_cap, blk_cap, d


def append_sparse_shm_allreduce(s: Schedule, size: int, dtype: Any = np.float32, *,
                                delta: float | None = None, dense: bool = False,
                                segments: Sequence[str], result: str, after: Sequence[int] = (),
                                tag_base: int = 0, attach: str | None = None
                                ) -> tuple[int, BufRef, str]:
    """Append the shared-memory split allgather to the uncommitted schedule ``s`` (module doc), for
    composing it with other ops (a partial collective's activation and snapshot).

    ``segments``: the slot of every rank's segment, in rank order (declared here unless already,
    :func:`shm_layout`'s two regions as bytes each); ``result``: the result slot to declare (a
    stream, or with ``dense`` ``size`` values). Its first sends wait for every op in ``after``;
    tags ``tag_base`` and ``tag_base + 1``. ``attach``: a kernel (no inputs, no output) run once
    every peer has said its input is in and before anything reads a peer's segment (a partial
    handle maps its peers' segments there the first time). Returns ``(done, input, result)``:
    the op after which the result is in place and every send done, the region of this rank's
    segment to write the input stream into before ``after`` completes, and ``result``."""
    if not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    dt = np.dtype(dtype)
    if dt.kind not in "fiu":
        raise TypeError(f"dtype must be a float or integer dtype, got {dt}")
    if delta is not None and (math.isnan(delta) or delta < 0):
        raise ValueError(f"delta must be >= 0 (math.inf: never switch to dense), got {delta!r}")
    P, r = s.world_size, s.rank
    if len(segments) != P:
        raise ValueError(f"segments must name {P} slots, one per rank, got {len(segments)}")
    in_cap, blk_cap, d = shm_layout(int(size), dt, delta, P)
    seg_spec = SlotSpec(in_cap + blk_cap, "|u1")
    for slot in segments:
        if slot not in s.slots:  # (a caller that writes the input region first declared it)
            s.declare(slot, seg_spec)
        elif s.slots[slot] != seg_spec:
            raise ValueError(f"slot {slot!r} is declared as {s.slots[slot]}, the segment needs "
                             f"{seg_spec}")
    if dense:
        s.declare(result, SlotSpec(int(size), dtype_to_wire(dt)))
    else:
        s.declare(result, SlotSpec(stream_capacity(int(size), dt, d), "|u1"))
    lo, hi = partition(int(size), P)[r]
    p: dict[str, Any] = {"n": int(size), "dtype": dtype_to_wire(dt),
                         "delta": None if math.isinf(d) else d,
                         "input_bytes": in_cap, "block_bytes": blk_cap, "dense": dense}
    others = [q for q in range(P) if q != r]
    for q in others:
        s.send(q, None, tag_base + _TAG_IN, deps=after, label="input in")
    got = [s.recv(q, None, tag_base + _TAG_IN, label="input in") for q in others]
    if attach is not None and others:
        got = [s.compute(attach, [], None, deps=got, label="map the peers' segments")]
    red = s.compute("sparse.shm_reduce", list(segments), BufRef(segments[r], in_cap, blk_cap),
                    deps=[*got, *after], label=f"reduce range {r}", lo=lo, hi=hi, **p)
    told = [s.send(q, None, tag_base + _TAG_REDUCED, deps=red, label="block in")
            for q in others]
    reduced = [s.recv(q, None, tag_base + _TAG_REDUCED, label="block in") for q in others]
    asm = s.compute("sparse.shm_assemble", list(segments), result, deps=[red, *reduced],
                    label="assemble", **p)
    done = s.nop(deps=[asm, *told], label="sparse allreduce done")
    return done, BufRef(segments[r], 0, in_cap), result


def build_sparse_shm_allreduce(rank: int, world_size: int, size: int, dtype: Any = np.float32,
                               *, delta: float | None = None, dense: bool = False,
                               attach: str | None = None) -> Schedule:
    """The committed schedule of ``rank`` (module doc). Slots: ``seg{q}`` for every rank q
    (its whole segment as bytes; ``seg{rank}`` this rank's own, writable), and the result:
    ``res`` (a stream) or, with ``dense``, ``out`` (``size`` values). ``meta``: ``input``
    (this rank's segment slot), ``result``, ``input_bytes``, ``block_bytes``, ``delta``.
    ``attach``: as :func:`append_sparse_shm_allreduce`'s (a persistent handle's, whose peer
    segments are mapped at its first execution; the kernel is the executor's to provide).
    Raises ``ValueError`` naming a bad argument."""
    P, r = world_size, rank
    algorithm = SHM_SPARSE_ALGORITHMS[1 if dense else 0]
    s = Schedule(r, P, name=f"sparse_allreduce/{algorithm}/shm")
    segs = [f"seg{q}" for q in range(P)]
    done, _inp, result = append_sparse_shm_allreduce(s, size, dtype, delta=delta, dense=dense,
                                                     segments=segs,
                                                     result="out" if dense else "res",
                                                     attach=attach)
    s.final = done
    dt = np.dtype(dtype)
    in_cap, blk_cap, d = shm_layout(int(size), dt, delta, P)
    s.meta.update(input=segs[r], result=result, input_bytes=in_cap, block_bytes=blk_cap,
                  delta=None if math.isinf(d) else d, algorithm=algorithm, size=int(size),
                  dtype=dtype_to_wire(dt))
    s.meta["collectives"] = [{"kind": "sparse_allreduce", "size": int(size),
                              "dtype": dtype_to_wire(dt), "algorithm": algorithm, "shm": True,
                              "delta": None if math.isinf(d) else d}]
    return s.commit(SPARSE_KERNELS if attach is None else [*SPARSE_KERNELS, attach])
