"""Dense, synchronous collectives as schedule builders: allreduce, broadcast, allgather,
reduce-scatter and barrier, for any world size P >= 1.

Every collective comes in two forms:

* the **appending form** ``build_X(s, ...) -> int`` adds the collective's ops to an uncommitted
  :class:`~asynccoll.sched.Schedule` ``s`` (for ``s.rank`` of ``s.world_size``) and returns the id
  of a no-op that completes when the collective is done on this rank (every send has completed,
  so every buffer is free again). Its first ops depend on all of ``after`` (AND); with
  ``after=()`` it adds a no-op *start* source, so no receive is posted before the rank starts the
  execution (receives write into the caller's buffer in place). It declares the slots it uses;
  a slot that is already declared must agree in element count and dtype.
* the **convenience form** ``X(rank, world_size, ...) -> Schedule`` builds a fresh schedule with
  the appending form, makes its result op the schedule's ``final`` op and commits it.

Conventions shared by every builder:

* ``count`` is in elements of ``dtype``; any NumPy numeric dtype that travels on the wire (bool,
  signed and unsigned 8-64-bit integers, float16/32/64, complex64/128). ``bool`` reduces as
  logic: ``sum``/``max`` are OR, ``prod``/``min`` are AND. ``op`` is one of ``sum``, ``prod``,
  ``min``, ``max`` (the registered kernels of the same names; on complex numbers ``min``/``max``
  order as NumPy does, lexicographically).
* Collectives work **in place** on the caller's slot (``slot``, default ``"data"``); scratch
  slots are named ``scratch_prefix + "tmp"`` and their sizes are declared in the schedule
  (:func:`scratch_slots`, :func:`scratch_buffers`).
* Tags: a builder uses tags ``tag_base, tag_base + 1, ...`` up to, not including, what
  :func:`next_tag` returns afterwards; each (sender, receiver) message pair has its own tag. To
  append a second collective, pass ``tag_base=next_tag(s)``.
* Large messages move in segments of ``segment_bytes`` (default 1 MiB); a segment's reduction
  depends only on its own receive, so transfer and reduction overlap. ``segment_bytes`` must be
  the same on every rank.
* ``count == 0`` moves nothing and completes at once (as MPI's collectives with count 0); the
  barrier is the only collective that always synchronises.
* Every rank ends with bitwise identical results: each element is reduced once, in one order,
  and the result is copied (sum and product of IEEE numbers commute exactly).

Bad arguments raise ``ValueError`` naming the argument. Building costs no I/O and about
30-40 µs per op (commit included): a few hundred ops for 16 MiB at P = 16.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..buffers import is_cupy
from ..sched import Schedule
from ._plan import REDUCE_OPS, Plan, block_bounds, check_count, check_dtype, check_op
from .select import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    REDUCE_SCATTER_ALGORITHMS,
    choose_allgather,
    choose_allreduce,
    choose_broadcast,
    choose_reduce_scatter,
)

__all__ = [
    "ALLGATHER_ALGORITHMS",
    "ALLREDUCE_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "DEFAULT_SEGMENT_BYTES",
    "REDUCE_OPS",
    "REDUCE_SCATTER_ALGORITHMS",
    "first_partner",
    "allgather",
    "allreduce",
    "barrier",
    "block_bounds",
    "broadcast",
    "build_allgather",
    "build_allreduce",
    "build_barrier",
    "build_broadcast",
    "build_reduce_scatter",
    "next_tag",
    "reduce_scatter",
    "scratch_buffers",
    "scratch_slots",
]

#: messages larger than this move in segments of this many bytes.
DEFAULT_SEGMENT_BYTES = 1 << 20


# -- allreduce ---------------------------------------------------------------------------------
def build_allreduce(s: Schedule, count: int, dtype: Any, op: str = "sum",
                    algorithm: str | None = None, *, slot: str = "data",
                    scratch_prefix: str = "", tag_base: int = 0, after: Sequence[int] = (),
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                    source_first_recvs: bool = False) -> int:
    """Append an allreduce of ``count`` elements of slot ``slot`` (reduced in place) to ``s``.

    ``algorithm``: ``"recursive_doubling"``, ``"ring"``, ``"rabenseifner"``, or ``None`` to let
    :func:`~asynccoll.collectives.select.choose_allreduce` pick by P and message size. Recursive
    doubling and Rabenseifner fold the ranks beyond the largest power of two onto partners.

    Slots: ``slot`` (``count`` elements, in place) and scratch ``scratch_prefix + "tmp"``
    (``count`` elements for recursive doubling and Rabenseifner, two blocks of
    ``ceil(count / P)`` for ring; absent when P == 1 or count == 0).
    ``source_first_recvs``: with P a power of two and recursive doubling or Rabenseifner, the
    receives of the first exchange (partner :func:`first_partner`) are sources, posted when
    the execution is armed rather than after ``after`` (a partial collective lets them
    activate the rank: fused activation); ignored otherwise.
    Returns the id of the no-op that completes when the result is in ``slot`` on this rank.
    Raises ``ValueError`` naming a bad ``count``, ``dtype``, ``op``, ``algorithm``,
    ``tag_base``, ``after`` or ``segment_bytes``.
    """
    check_op(op)
    p = _plan(s, count, dtype, tag_base, after, segment_bytes, slot)
    P = s.world_size
    nbytes = count * p.itemsize
    algo = choose_allreduce(P, nbytes) if algorithm is None else algorithm
    if algo not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALLREDUCE_ALGORITHMS} or None, "
                         f"got {algo!r}")
    _record(s, "allreduce", count=count, dtype=p.dtype_name, op=op, algorithm=algo,
            slot=slot)
    if P > 1 and count > 0:
        tmp = scratch_prefix + "tmp"
        if algo == "ring":
            b = block_bounds(count, P)
            p.scratch(tmp, 2 * (b[1] - b[0]))
            p.ring_reduce_scatter(slot, tmp, op, b)
            p.ring_allgather(slot, b)
        else:
            p.scratch(tmp, count)
            core = p.fold_in(slot, tmp, op)
            # a folded rank still reserves the core's tags, so next_tag() agrees on all ranks
            p.dry = core < 0
            p.source_recvs = source_first_recvs and P & (P - 1) == 0
            if algo == "recursive_doubling":
                p.recursive_doubling(slot, tmp, op, max(core, 0))
            else:
                p.rabenseifner(slot, tmp, op, max(core, 0))
            p.dry = False
            p.fold_out(slot)
    return p.finish()


def first_partner(rank: int, world_size: int, count: int, algorithm: str) -> int | None:
    """The rank this rank's allreduce of ``count`` elements first exchanges data with, when
    P is a power of two and ``algorithm`` exchanges along a hypercube dimension first
    (recursive doubling: ``rank ^ 1``; Rabenseifner's halving: ``rank ^ P/2``); else None.
    Every rank computes the same pairs, which is what fused activation relies on."""
    P = world_size
    if P < 2 or P & (P - 1) or count <= 0:
        return None
    if algorithm == "recursive_doubling":
        return rank ^ 1
    if algorithm == "rabenseifner" and count >= P:
        # with fewer elements than ranks some blocks are empty, and a rank whose first
        # halving step receives nothing could not be activated by it
        return rank ^ (P >> 1)
    return None


def allreduce(rank: int, world_size: int, count: int, dtype: Any, op: str = "sum",
              algorithm: str | None = None, *, tag_base: int = 0,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Schedule:
    """A committed allreduce schedule for ``rank`` of ``world_size`` (see :func:`build_allreduce`).

    Bind ``"data"`` (``count`` elements of ``dtype``: input, then result) and the scratch slots
    of :func:`scratch_buffers`.
    """
    return _single("allreduce", rank, world_size, lambda s: build_allreduce(
        s, count, dtype, op, algorithm, tag_base=tag_base, segment_bytes=segment_bytes))


# -- broadcast ---------------------------------------------------------------------------------
def build_broadcast(s: Schedule, count: int, dtype: Any, root: int = 0,
                    algorithm: str | None = None, *, slot: str = "data", tag_base: int = 0,
                    after: Sequence[int] = (),
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Append a broadcast of ``count`` elements of ``slot`` from ``root``.

    ``slot`` holds the root's data, and receives it in place on the other ranks. No scratch.
    ``algorithm``: ``"binomial"`` (a binomial tree, ceil(log2 P) deep; segments are forwarded
    as soon as each arrives), ``"scatter_allgather"`` (a binomial scatter of P blocks, then a
    ring allgather: about 2n bytes on the critical path instead of n·log2 P), or ``None``:
    :func:`~asynccoll.collectives.select.choose_broadcast`. Raises ``ValueError`` naming a bad
    ``root`` (outside 0..P-1), ``algorithm`` or any argument :func:`build_allreduce` checks.
    """
    P = s.world_size
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < P:
        raise ValueError(f"root must be a rank in 0..{P - 1}, got {root!r}")
    p = _plan(s, count, dtype, tag_base, after, segment_bytes, slot)
    algo = choose_broadcast(P, count * p.itemsize) if algorithm is None else algorithm
    if algo not in BROADCAST_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {BROADCAST_ALGORITHMS} or None, "
                         f"got {algo!r}")
    _record(s, "broadcast", count=count, dtype=p.dtype_name, root=int(root), algorithm=algo,
            slot=slot)
    if P > 1 and count > 0:
        if algo == "binomial":
            p.binomial_broadcast(slot, int(root))
        else:
            b = block_bounds(count, P)  # block i goes to rank root + i
            p.binomial_scatter(slot, int(root), b)
            p.ring_allgather(slot, b, shift=int(root))
    return p.finish()


def broadcast(rank: int, world_size: int, count: int, dtype: Any, root: int = 0,
              algorithm: str | None = None, *, tag_base: int = 0,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Schedule:
    """A committed broadcast schedule (see :func:`build_broadcast`); bind ``"data"``."""
    return _single("broadcast", rank, world_size, lambda s: build_broadcast(
        s, count, dtype, root, algorithm, tag_base=tag_base, segment_bytes=segment_bytes))


# -- allgather ---------------------------------------------------------------------------------
def build_allgather(s: Schedule, count: int, dtype: Any, algorithm: str | None = None, *,
                    slot: str = "data", scratch_prefix: str = "", tag_base: int = 0,
                    after: Sequence[int] = (),
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Append an allgather of ``count`` elements per rank.

    ``slot`` has ``P * count`` elements; rank r's contribution is in place at
    ``[r * count, (r + 1) * count)`` on entry, and every rank holds all of them on exit (as
    MPI_Allgather with MPI_IN_PLACE). ``algorithm``: ``"ring"`` (P - 1 steps, no scratch, no
    copies), ``"bruck"`` (ceil(log2 P) steps for any P; scratch ``scratch_prefix + "tmp"`` of
    ``P * count`` elements and two local copies), or ``None``:
    :func:`~asynccoll.collectives.select.choose_allgather` (Bruck for small blocks). Both move
    ``(P - 1) * count`` elements per rank, segmented.
    """
    P = s.world_size
    p = _plan(s, count, dtype, tag_base, after, segment_bytes, slot, slot_count=count * P)
    algo = choose_allgather(P, count * p.itemsize) if algorithm is None else algorithm
    if algo not in ALLGATHER_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALLGATHER_ALGORITHMS} or None, "
                         f"got {algo!r}")
    _record(s, "allgather", count=count, dtype=p.dtype_name, algorithm=algo, slot=slot)
    if P > 1 and count > 0:
        if algo == "ring":
            p.ring_allgather(slot, [count * r for r in range(P + 1)])
        else:
            tmp = scratch_prefix + "tmp"
            p.scratch(tmp, P * count)
            p.bruck_allgather(slot, tmp, count)
    return p.finish()


def allgather(rank: int, world_size: int, count: int, dtype: Any,
              algorithm: str | None = None, *, tag_base: int = 0,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Schedule:
    """A committed allgather schedule (see :func:`build_allgather`); bind ``"data"`` of
    ``world_size * count`` elements and the scratch of :func:`scratch_buffers`."""
    return _single("allgather", rank, world_size, lambda s: build_allgather(
        s, count, dtype, algorithm, tag_base=tag_base, segment_bytes=segment_bytes))


# -- reduce-scatter ----------------------------------------------------------------------------
def build_reduce_scatter(s: Schedule, count: int, dtype: Any, op: str = "sum",
                         algorithm: str | None = None, *, slot: str = "data",
                         scratch_prefix: str = "", tag_base: int = 0,
                         after: Sequence[int] = (),
                         segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Append a reduce-scatter of ``count`` elements of ``slot``.

    ``count`` is the **total** length. It is split into P blocks as :func:`block_bounds` says
    (``numpy.array_split``'s rule: the first ``count % P`` blocks have one element more), so it
    is MPI_Reduce_scatter_block when P divides ``count`` and MPI_Reduce_scatter with those
    counts otherwise. On exit rank r's block ``slot[b[r]:b[r+1]]`` (``b = block_bounds(count,
    P)``) holds the reduction of everyone's block r; the rest of ``slot`` holds partial sums.

    ``algorithm``: ``"ring"`` (P - 1 steps; scratch ``scratch_prefix + "tmp"`` of two blocks),
    ``"recursive_halving"`` (log2 P steps, P a power of two only, else ``ValueError``; scratch
    of ``count`` elements), or ``None``:
    :func:`~asynccoll.collectives.select.choose_reduce_scatter`. Both move ``count·(P-1)/P``
    elements per rank, segmented.
    """
    check_op(op)
    P = s.world_size
    p = _plan(s, count, dtype, tag_base, after, segment_bytes, slot)
    algo = choose_reduce_scatter(P, count * p.itemsize) if algorithm is None else algorithm
    if algo not in REDUCE_SCATTER_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {REDUCE_SCATTER_ALGORITHMS} or None, "
                         f"got {algo!r}")
    if algo == "recursive_halving" and P & (P - 1):
        raise ValueError(f"algorithm 'recursive_halving' needs a power-of-two world size, "
                         f"got {P}; use 'ring'")
    _record(s, "reduce_scatter", count=count, dtype=p.dtype_name, op=op, algorithm=algo,
            slot=slot)
    if P > 1 and count > 0:
        b = block_bounds(count, P)
        tmp = scratch_prefix + "tmp"
        if algo == "ring":
            p.scratch(tmp, 2 * (b[1] - b[0]))
            p.ring_reduce_scatter(slot, tmp, op, b)
        else:
            p.scratch(tmp, count)
            p.halving_reduce_scatter(slot, tmp, op)
    return p.finish()


def reduce_scatter(rank: int, world_size: int, count: int, dtype: Any, op: str = "sum",
                   algorithm: str | None = None, *, tag_base: int = 0,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Schedule:
    """A committed reduce-scatter schedule (see :func:`build_reduce_scatter`)."""
    return _single("reduce_scatter", rank, world_size, lambda s: build_reduce_scatter(
        s, count, dtype, op, algorithm, tag_base=tag_base, segment_bytes=segment_bytes))


# -- barrier -----------------------------------------------------------------------------------
def build_barrier(s: Schedule, *, tag_base: int = 0, after: Sequence[int] = ()) -> int:
    """Append a dissemination barrier: ceil(log2 P) rounds of empty messages.

    In round i rank r sends to r + 2**i and receives from r - 2**i (mod P); a round's send waits
    for the receives of all earlier rounds. The result op completes only after every rank has
    entered the barrier. No slots.
    """
    p = _plan(s, 0, "uint8", tag_base, after, DEFAULT_SEGMENT_BYTES, None)
    _record(s, "barrier")
    p.dissemination()
    return p.finish()


def barrier(rank: int, world_size: int, *, tag_base: int = 0) -> Schedule:
    """A committed barrier schedule (see :func:`build_barrier`); it has no slots."""
    return _single("barrier", rank, world_size, lambda s: build_barrier(s, tag_base=tag_base))


# -- helpers -----------------------------------------------------------------------------------
def next_tag(s: Schedule) -> int:
    """The first tag no builder has used in ``s`` (``tag_base`` for the next collective)."""
    return int(s.meta.get("next_tag", 0))


def scratch_slots(s: Schedule) -> dict[str, int]:
    """The scratch slots the builders declared in ``s``: name -> element count.

    Their dtype is the schedule's ``SlotSpec.dtype``. The caller allocates them once and binds
    them with the data; their contents between executions mean nothing.
    """
    return {k: int(v) for k, v in s.meta.get("scratch", {}).items()}


def scratch_buffers(s: Schedule, like: Any = None) -> dict[str, Any]:
    """Fresh arrays for :func:`scratch_slots` of ``s``, each of its slot's dtype: NumPy arrays,
    or CuPy arrays when ``like`` is one (on the current device)."""
    if like is not None and is_cupy(like):
        import cupy

        alloc: Callable[[int, np.dtype[Any]], Any] = cupy.empty
    else:
        alloc = np.empty
    return {name: alloc(n, np.dtype(s.slots[name].dtype or "uint8"))
            for name, n in scratch_slots(s).items()}


def _plan(s: Schedule, count: int, dtype: Any, tag_base: int, after: Sequence[int],
          segment_bytes: int, slot: str | None, slot_count: int | None = None) -> Plan:
    check_count(count)
    dt = check_dtype(dtype)
    if not isinstance(tag_base, (int, np.integer)) or tag_base < 0:
        raise ValueError(f"tag_base must be an int >= 0, got {tag_base!r}")
    if not isinstance(segment_bytes, (int, np.integer)) or segment_bytes < 1:
        raise ValueError(f"segment_bytes must be an int >= 1, got {segment_bytes!r}")
    n_ops = len(s.ops)
    bad = [a for a in after if not isinstance(a, (int, np.integer)) or not 0 <= a < n_ops]
    if bad:
        raise ValueError(f"after must name existing op ids (0..{n_ops - 1}), got {bad}")
    p = Plan(s, dt, int(tag_base), [int(a) for a in after], int(segment_bytes))
    if slot is not None:
        p.data_slot(slot, count if slot_count is None else slot_count)
    return p


def _record(s: Schedule, kind: str, **info: Any) -> None:
    s.meta.setdefault("collectives", []).append({"kind": kind, **info})


def _single(kind: str, rank: int, world_size: int, build: Callable[[Schedule], int]) -> Schedule:
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    s = Schedule(int(rank), int(world_size), name=kind)
    s.final = build(s)
    return s.commit()

