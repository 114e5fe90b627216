"""The allreduce between the ranks of one host, through shared memory (one-shot and two-shot).

Every rank owns a segment (a file in ``/dev/shm`` that every rank maps). A call, for rank r of
P, first copies the caller's array (two-shot: the blocks the peers reduce) into r's own segment
and tells every peer (an empty message over the communicator's existing connections: the
wake-up, no spinning). Then:

* **one-shot** (small and medium messages: :data:`SHM_ONE_SHOT_READ`): once told by
  every peer, r reduces the *whole* vector straight out of all P segments, in rank order (so
  every rank computes bitwise the same sum), into the caller's array. One wake-up round; each
  rank reads P vectors and writes two (the copy in, the result).
* **two-shot** (large messages), with the vector cut into P blocks (``numpy.array_split``'s
  rule): r copies in only the P - 1 blocks its peers reduce, telling each peer as soon as its
  block is in; once told by every peer, r reduces block r of the caller's array and of the
  peers' segments (read in place) into block r of its own segment, tells every peer again,
  then copies each block q out of the segment of the rank q that reduced it into the caller's
  array. Two wake-up rounds; each rank copies (P - 1) / P of the vector in and all of it out
  and reads its block P times, where one-shot reads the whole vector P times. Its own block
  never goes through its segment on the way in: at P = 4 that is a quarter less copied in,
  and the copies are NumPy's (memory bound, 16 MiB at about 1.3 ms here), so bytes are time.

Where the ranks may read and write each other's memory, the communicator's default takes
:mod:`.cma` (no segments, no copy in) at two-shot's sizes instead; two-shot here serves the
rest, and ``algorithm="shm_two_shot"``.

So one-shot trades P - 1 reads of the vector (cheap while it stays in the caches) for a
wake-up round (tens of microseconds per hop on a loaded machine, and the slowest peer's
scheduling delay). :func:`choose_shm` picks by size (the same answer on every rank). At small
sizes the recursive-doubling allreduce over the network costs fewer messages still, so the
communicator takes this path only from :data:`SHM_MIN_BYTES` up (or when asked for,
``algorithm="shm"``, ``"shm_one_shot"`` or ``"shm_two_shot"``), and only when every rank of
the communicator is on this host (:func:`host_id`, compared at first use).

**Reuse without another message.** Calls alternate between two executors with two segments
each: rank r writes into the segment of call n again at call n + 2, only after its call n + 1
completed. That completion needs the "copied in" message of call n + 1 from every peer q (the
reduce of either algorithm waits for all of them), and q sends it only after its own call n
returned, that is after q finished every read of r's segment of call n (one-shot: the reduce;
two-shot: the reduce and the copy out, both before q's final op). So one round (one-shot) or
two (two-shot) suffice, never a third.

**Arrays that live in shared memory.** :meth:`Communicator.empty
<asynccoll.Communicator.empty>` (collective) allocates an array in a segment of its own that
every peer maps; ``allreduce(x, out=x)`` of such an array skips the copy in (peers read it
where it is) and reduces it in place (:func:`build_shm_inplace`). Here one allocation serves
every call, and the caller may overwrite its array as soon as the call returns. Two-shot (the
default for these arrays at every size) pushes instead of pulling: each rank reduces its block
of every array in pieces that stay in the caches and writes each reduced piece at once into
every peer's array (mapped writable for this), then tells them "reduced into all"; a rank
whose peers all said so holds the whole sum, and no peer will read or write its array again
in the call (each read its block there before writing it). Two rounds, and per rank its block
of each array read once and written once, against a whole vector per array for one-shot
(forced one-shot takes two rounds too: the sum goes to a scratch buffer, and into the array
once every peer said it has read it).

**Across hosts** (:func:`build_hier_allreduce`): the ranks of each host sum their data through
shared memory (two-shot), the lowest rank of each host (its leader) allreduces the host sums
with the other leaders over the network (the dense schedule of the leaders, chosen by size and
their number), and each leader hands the result to its host's ranks through its segment. Each
byte crosses the network once per host instead of once per rank.

**Partial collectives** (:func:`build_shm_partial_allreduce`): a persistent partial handle
runs the same one-shot or two-shot pieces as its data phase, whose "written" messages also
activate; its segments (:class:`asynccoll.comm.shm.PartialSegments`) are bound to the slots
``mine`` and ``peer{q}``.

These are pure builders: the segments, their names and their lifetime are
:mod:`asynccoll.comm.shm`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..buffers import REDUCE_OPS as REDUCE_UFUNCS
from ..buffers import dtype_to_wire
from ..sched import BUILTIN_KERNELS, BufRef, KernelRegistry, Schedule, SlotSpec
from ._plan import block_bounds, check_op
from .activation import add_triggers
from .dense import REDUCE_OPS, build_allreduce
from .partial import (
    PARTIAL_KERNELS,
    SHM_ATTACH,
    STATE_LEN,
    TAG_DATA,
    append_activation_front,
    check_kind,
    commit_partial,
    meta_len,
    packs_meta,
    signature,
)

__all__ = ["SHM_ALGORITHMS", "SHM_ATTACH", "SHM_INPLACE_KERNELS", "SHM_INPLACE_OWN_KERNELS",
           "SHM_MIN_BYTES", "SHM_NAMES", "SHM_ONE_SHOT_READ", "SHM_PUSH", "SHM_PUSH_PIECE",
           "build_hier_allreduce", "build_shm_allreduce", "build_shm_inplace",
           "build_shm_partial_allreduce", "choose_shm", "host_groups", "shm_algorithm"]

#: the communicator's allreduce takes the shared-memory path from this many bytes up, when
#: every rank is on one host (below it, recursive doubling's fewer messages win)
SHM_MIN_BYTES = 128 << 10
#: the shared-memory allreduce is one-shot while the P vectors each rank reads (P times the
#: message) come to fewer bytes than this, two-shot from it up: at P = 4, below 4 MiB
SHM_ONE_SHOT_READ = 16 << 20

#: bytes of each piece of the two-shot allreduce of shared arrays (:func:`_k_push`): small
#: enough that a piece stays in the caches between its reduce and its writes
SHM_PUSH_PIECE = 256 << 10
#: the shared-memory algorithms (``algorithm="shm_" + name`` forces one)
SHM_ALGORITHMS = ("one_shot", "two_shot")
#: the ``algorithm=`` names of the allreduce through shared memory on one host: ``"shm"`` (by
#: size, :func:`choose_shm`), or one of :data:`SHM_ALGORITHMS` forced
SHM_NAMES = ("shm", *(f"shm_{a}" for a in SHM_ALGORITHMS))

_READY, _REDUCED, _DONE, _FINAL = 0, 1, 2, 3  # the tags of the wake-up rounds
_NET_TAG = 16  # the leaders' network allreduce of a hierarchical schedule starts here


def shm_algorithm(name: str | None) -> str | None:
    """The shared-memory algorithm the ``algorithm=`` name ``name`` forces (``None``: by
    size, for ``"shm"`` and ``None``)."""
    return name[4:] if name is not None and name.startswith("shm_") else None


def choose_shm(nbytes: int, world_size: int, algorithm: str | None = None) -> str:
    """``algorithm`` checked (one of :data:`SHM_ALGORITHMS`), or when ``None`` by the bytes
    one-shot would read per rank: one-shot while ``world_size * nbytes`` is below
    :data:`SHM_ONE_SHOT_READ`, else two-shot (measured at P = 2, 4, 8: one-shot wins up to
    there, two-shot from about twice that; docs/collectives.md). Raises ``ValueError``
    naming a bad ``algorithm``."""
    if algorithm is None:
        return "one_shot" if world_size * nbytes < SHM_ONE_SHOT_READ else "two_shot"
    if algorithm not in SHM_ALGORITHMS:
        raise ValueError(f"shared-memory algorithm must be one of {SHM_ALGORITHMS} or None, "
                         f"got {algorithm!r}")
    return algorithm


#: the scratch slot of the one-shot in-place allreduce (the sum, before it goes into place)
_SUM_SLOT = "shm_sum"


def build_shm_inplace(rank: int, world_size: int, count: int, dtype: Any,
                      op: str = "sum", algorithm: str | None = None) -> Schedule:
    """The schedule of an allreduce of an array that already lives in shared memory
    (:meth:`Communicator.empty <asynccoll.Communicator.empty>`): no copy in. Slots ``mine``
    (the caller's array, reduced in place) and ``peer{q}`` (rank q's array of the same
    allocation, mapped writable); one-shot adds the scratch slot ``shm_sum``
    (``scratch_buffers``). ``algorithm``: :func:`choose_shm`'s. Two-shot takes two wake-up
    rounds: "written", then "reduced into all" (kernel :data:`SHM_PUSH`: this rank's block of
    every array reduced and written back into each, module doc); one-shot two: "written",
    then "read" (every peer has read this rank's array, so the sum, reduced into scratch
    meanwhile, may go into it)."""
    _check(op, count)
    P, r = world_size, rank
    wire = np.dtype(dtype).str
    algo = choose_shm(count * np.dtype(dtype).itemsize, world_size, algorithm)
    s = Schedule(r, P, name="shm_allreduce_inplace")
    for slot in _segment_slots(r, range(P)).values():
        s.declare(slot, SlotSpec(count, wire))
    start = s.nop(label="start")
    others = [q for q in range(P) if q != r]
    if algo == "one_shot" and others:
        s.declare(_SUM_SLOT, SlotSpec(count, wire))
        s.meta.setdefault("scratch", {})[_SUM_SLOT] = count
        summed = _one_shot(s, range(P), op, start, _SUM_SLOT, "written")
        for q in others:
            s.send(q, None, _DONE, deps=summed, label="read")
        read = [s.recv(q, None, _DONE, label="read") for q in others]
        put = s.compute("copy", [_SUM_SLOT], "mine", deps=[summed, *read],
                        label="the sum into place")
        s.final = s.nop(deps=[put], label="final")
        return _commit(s, count, wire, op, "shm-inplace-one-shot")
    if not others:
        s.final = s.nop(deps=[start], label="final")
        return _commit(s, count, wire, op, "shm-inplace", SHM_INPLACE_KERNELS)
    ready = _told(s, others, start, "written", None)
    b = block_bounds(count, P)
    mine = BufRef("mine", b[r], b[r + 1] - b[r])
    if mine.count:
        reduced = s.compute(SHM_PUSH, [BufRef(f"peer{q}", b[r], mine.count) for q in others],
                            mine, deps=[start, *ready], label=f"reduce block {r} into all",
                            op=op)
    else:
        reduced = s.nop(deps=[start, *ready], label=f"block {r} is empty")
    for q in others:
        s.send(q, None, _REDUCED, deps=reduced, label="reduced into all")
    done = [s.recv(q, None, _REDUCED, label="reduced into all") for q in others]
    s.final = s.nop(deps=[reduced, *done], label="final")
    return _commit(s, count, wire, op, "shm-inplace", SHM_INPLACE_KERNELS)


def build_shm_allreduce(rank: int, world_size: int, count: int, dtype: Any,
                        op: str = "sum", algorithm: str | None = None) -> Schedule:
    """The committed schedule of rank ``rank`` (module doc). Slots: ``data`` (the caller's
    array, reduced in place), ``mine`` (this rank's segment), ``peer{q}`` (rank q's segment,
    read-only), ``count`` elements of ``dtype`` each. ``algorithm``: ``"one_shot"``,
    ``"two_shot"`` or ``None`` (:func:`choose_shm`). Raises ``ValueError`` naming a bad
    ``op``, ``count`` or ``algorithm``."""
    _check(op, count)
    P, r = world_size, rank
    wire = np.dtype(dtype).str
    algo = choose_shm(count * np.dtype(dtype).itemsize, world_size, algorithm)
    s = Schedule(r, P, name="shm_allreduce")
    for slot in ("data", *_segment_slots(r, range(P)).values()):
        s.declare(slot, SlotSpec(count, wire))
    if algo == "one_shot":
        copied = s.compute("copy", ["data"], "mine", label="copy in")
        outs = [_one_shot(s, range(P), op, copied, "data", "copied in")]
    else:
        start = s.nop(label="start")
        outs = _two_shot(s, range(P), count, op, start, "data", "copied in", src="data")
    s.final = s.nop(deps=outs, label="final")
    return _commit(s, count, wire, op, "shm" if algo == "two_shot" else "shm-one-shot")




def build_shm_partial_allreduce(rank: int, world_size: int, count: int, dtype: Any, *,
                                kind: str = "solo", op: str = "sum",
                                quorum: int | None = None,
                                algorithm: str | None = None) -> Schedule:
    """The persistent schedule of a partial allreduce whose data phase goes through shared
    memory (every rank on one host): the activation front of
    :func:`~asynccoll.collectives.partial.build_partial_allreduce` without its broadcast,
    the snapshot straight into this rank's segment (``mine``: the copy in), then the
    one-shot or two-shot sum (``algorithm``, :func:`choose_shm`) into the work buffer
    ``data``.

    **Activation by the data.** Every activated rank snapshots and then tells every other rank
    that its segment is written; the first such message activates a rank that was not
    activated yet (an OR with its own triggers, as the fused activation of the network
    schedule). So the "written" round is the activation broadcast too: one hop from any
    initiator, instead of ``ceil(log2 P)`` hops and then the data.

    Slots: those of the network schedule (``acc``, ``data``, ``meta``, ``state``, the meta's
    scratch when the meta vector is not packed), plus ``mine`` and ``peer{q}`` (``data``'s
    length each; bound to the two alternating sets of :class:`PartialSegments`). The compute
    op :data:`SHM_ATTACH` (the handle's kernel) runs after every peer said "written" and
    before anything reads a peer's segment. Raises ``ValueError`` as the network builder.
    """
    P = world_size
    k = check_kind(kind, P, quorum)
    check_op(op)
    _check(op, count)
    dt = np.dtype(dtype)
    wire = dtype_to_wire(dt)
    packed = packs_meta(dt, op, P)
    m = meta_len(P)
    n = count + (m if packed else 0)
    algo = choose_shm(n * dt.itemsize, P, algorithm)
    s = Schedule(rank, P, name=f"partial_allreduce.{kind}.shm")
    s.declare("acc", SlotSpec(count, wire))
    for slot in ("data", *_segment_slots(rank, range(P)).values()):
        s.declare(slot, SlotSpec(n, wire))
    s.declare("meta", SlotSpec(m, "<i8"))
    s.declare("state", SlotSpec(STATE_LEN, "<i8"))
    activated = append_activation_front(s, k, broadcast=False)
    sig = signature(kind, op, quorum, count, dt, f"shm_{algo}")
    snap = s.compute("partial_snapshot", ["acc", "mine", "meta", "state"], deps=activated,
                     label="snapshot into the segment", rank=rank, world_size=P, op=op,
                     sig=sig, packed=packed, count=count)
    first = len(s.ops)
    if algo == "one_shot":
        done = [_one_shot(s, range(P), op, snap, "data", "written", SHM_ATTACH, TAG_DATA)]
    else:
        done = _two_shot(s, range(P), n, op, snap, "data", "written", SHM_ATTACH, TAG_DATA)
    s.meta["next_tag"] = TAG_DATA + _DONE
    written = [i for i in range(first, len(s.ops))
               if s.ops[i].kind == "recv" and s.ops[i].tag == TAG_DATA + _READY]
    add_triggers(s, activated, written)
    return commit_partial(s, done, snap, {"kind": kind, "op": op, "quorum": k, "count": count,
                                          "dtype": wire, "packed": packed, "shm": algo},
                          [*PARTIAL_KERNELS, SHM_ATTACH])


def host_groups(hosts: Sequence[int]) -> list[list[int]]:
    """The ranks of each host (``hosts[r]``: rank r's host hash), in increasing order of
    their lowest rank (its leader)."""
    groups: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    return sorted(groups.values())


def build_hier_allreduce(rank: int, world_size: int, count: int, dtype: Any, op: str,
                         groups: Sequence[Sequence[int]],
                         algorithm: str | None = None) -> Schedule:
    """The hierarchical allreduce of rank ``rank`` (module doc, "Across hosts"): ``groups``
    the ranks of each host (:func:`host_groups`), ``algorithm`` the leaders' network
    allreduce (``None``: by size and the number of hosts). Slots ``data`` (reduced in place),
    ``mine`` (this rank's segment) and ``peer{q}`` for the other ranks of its host, plus the
    leaders' scratch (``scratch_buffers``). Raises ``ValueError`` naming a bad ``op`` or
    ``count``, or ``groups`` that do not partition the ranks."""
    _check(op, count)
    if sorted(q for g in groups for q in g) != list(range(world_size)):
        raise ValueError(f"groups must partition ranks 0..{world_size - 1}, got {groups}")
    r = rank
    g = sorted(next(g for g in groups if r in g))
    leaders = sorted(min(h) for h in groups)
    lead = g[0]
    wire = np.dtype(dtype).str
    s = Schedule(r, world_size, name="hier_allreduce")
    seg = _segment_slots(r, g)
    for slot in ("data", *seg.values()):
        s.declare(slot, SlotSpec(count, wire))
    others = [q for q in g if q != r]
    start = s.nop(label="start")
    host_done = start
    if others:  # the host's sum, on every rank of the host (two-shot over shared memory)
        host_done = s.nop(deps=_two_shot(s, g, count, op, start, "data", "copied in",
                                         src="data"), label="host sum")
    if r != lead:
        # hand the leader its segment back, then take the result out of it
        s.send(lead, None, _DONE, deps=host_done, label="copied out")
        told = s.recv(lead, None, _FINAL, label="result in the leader's segment")
        res = s.compute("copy", [seg[lead]], "data", deps=[told, host_done],
                        label="copy the result in")
        s.final = s.nop(deps=[res], label="final")
        return _commit(s, count, wire, op, "hier")
    net_done = host_done
    if len(leaders) > 1:
        net_done = _embed(s, leaders, host_done, lambda sub: build_allreduce(
            sub, count, dtype, op, algorithm, slot="data", tag_base=_NET_TAG))
    if others:
        freed = [s.recv(q, None, _DONE, label="copied out") for q in others]
        put = s.compute("copy", ["data"], "mine", deps=[net_done, *freed],
                        label="result into the segment")
        for q in others:
            s.send(q, None, _FINAL, deps=put, label="result in the segment")
        s.final = s.nop(deps=[put], label="final")
    else:
        s.final = s.nop(deps=[net_done], label="final")
    return _commit(s, count, wire, op, "hier")


def _segment_slots(rank: int, group: Iterable[int]) -> dict[int, str]:
    """The slot of each rank's segment: ``mine`` for this rank, ``peer{q}`` for the others."""
    return {q: "mine" if q == rank else f"peer{q}" for q in group}


def _one_shot(s: Schedule, group: Sequence[int], op: str, after: int, into: str | BufRef,
              said: str, attach: str | None = None, tag_base: int = 0) -> int:
    """Append the one-shot sum over the segments of ``group`` (this rank among them) once op
    ``after`` has the data in ``mine``: tell the peers (label ``said``), then reduce every
    segment, in the order of ``group`` (the same on every rank, so the same bits), into
    ``into`` (not ``mine``: the peers read it meanwhile). Returns the reduce op.
    ``attach``: a kernel (no inputs, no output) run once every peer has said so and before
    anything reads a peer's segment (:func:`_told`). Tags from ``tag_base``."""
    r = s.rank
    seg = _segment_slots(r, group)
    others = [q for q in group if q != r]
    if not others:
        return s.compute("copy", ["mine"], into, deps=after, label="copy out")
    ready = _told(s, others, after, said, attach, tag_base)
    return s.compute(op, [seg[q] for q in group], into, deps=[after, *ready],
                     label=f"reduce all {len(seg)} segments")


def _told(s: Schedule, others: Sequence[int], after: int, said: str, attach: str | None,
          tag_base: int = 0) -> list[int]:
    """Tell ``others`` once op ``after`` is done; return the ops after which every one of
    them has told this rank (its segment written), the ``attach`` kernel's op when given
    (the shared-memory partial allreduce maps a peer's segment there, the first time)."""
    for q in others:
        s.send(q, None, tag_base + _READY, deps=after, label=said)
    ready = [s.recv(q, None, tag_base + _READY, label=said) for q in others]
    if attach is None:
        return ready
    return [s.compute(attach, [], None, deps=ready, label="map the peers' segments")]


def _two_shot(s: Schedule, group: Sequence[int], count: int, op: str, after: int, into: str,
              said: str, attach: str | None = None, tag_base: int = 0,
              src: str = "mine") -> list[int]:
    """Append the two-shot sum over the segments of ``group`` (this rank among them) once op
    ``after`` has this rank's data in slot ``src``: tell the peers (label ``said``), reduce
    this rank's block of every segment into ``mine``, tell them again, copy every block into
    slot ``into`` (this rank's own only when ``into`` is not ``mine``). Returns the ops whose
    completion means ``into`` holds the sum. ``attach``, ``tag_base``: as :func:`_one_shot`'s.

    ``src`` other than ``mine`` (the caller's array): this rank copies into its segment only
    the blocks its peers reduce, each one followed at once by the "told" message to the rank
    that reduces it (so that rank may start before the other blocks are in), and reduces its
    own block straight out of ``src``: a quarter less copied in at P = 4 (module doc)."""
    r = s.rank
    i = list(group).index(r)
    seg = _segment_slots(r, group)
    others = [q for q in group if q != r]
    b = block_bounds(count, len(group))

    def block(slot: str, j: int) -> BufRef:
        return BufRef(slot, b[j], b[j + 1] - b[j])

    if not others:
        return [after if into == src else
                s.compute("copy", [src], into, deps=after, label="copy out")]
    if src == "mine":
        ready = _told(s, others, after, said, attach, tag_base)
    else:
        # Each rank starts with the block of the rank after it, so that the ranks do not all
        # copy the same peer's block first; the copies are chained (one after another, each
        # told at once) rather than independent, so the first peer hears as early as it can.
        n, prev = len(group), after
        for step in range(1, n):
            j = (i + step) % n
            prev = s.compute("copy", [block(src, j)], block("mine", j), deps=prev,
                             label=f"copy in block {j}")
            s.send(group[j], None, tag_base + _READY, deps=prev, label=said)
        ready = [s.recv(q, None, tag_base + _READY, label=said) for q in others]
        if attach is not None:
            ready = [s.compute(attach, [], None, deps=ready, label="map the peers' segments")]
    mine = block("mine", i)
    reduced = s.compute(op, [block(src, i), *(block(seg[q], i) for q in others)], mine,
                        deps=[after, *ready], label=f"reduce block {i}")
    for q in others:
        s.send(q, None, tag_base + _REDUCED, deps=reduced, label="reduced")
    outs = [reduced if into == "mine" else s.compute(
        "copy", [mine], block(into, i), deps=reduced, label=f"copy out block {i}")]
    for j, q in enumerate(group):
        if q == r:
            continue
        got = s.recv(q, None, tag_base + _REDUCED, label="reduced")
        outs.append(s.compute("copy", [block(seg[q], j)], block(into, j),
                              deps=[got, reduced], label=f"copy out block {j}"))
    return outs


def _k_push(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> None:
    """Reduce this rank's block (``out``, in its own shared array) with the same block of each
    peer's array (``inputs``, in rank order: the bits of the two-shot over segments) and write
    the result into each of theirs, piece by piece (:data:`SHM_PUSH_PIECE`): each piece is
    read from every peer and added, then written into every peer while it is still in the
    caches. Nobody else reads or writes a peer's block of this rank in the call."""
    fn = REDUCE_UFUNCS[params["op"]]
    if out.dtype.kind == "b":
        fn = np.logical_or if params["op"] in ("sum", "max") else np.logical_and
    per = max(1, SHM_PUSH_PIECE // out.itemsize)
    for lo in range(0, out.size, per):
        hi = lo + per
        mine = out[lo:hi]
        for x in inputs:
            fn(mine, x[lo:hi], out=mine)
        for x in inputs:
            np.copyto(x[lo:hi], mine)


#: the kernel of the two-shot allreduce of shared arrays (:func:`build_shm_inplace`)
SHM_PUSH = "shm_push"
#: the kernels :func:`build_shm_inplace` names beside the built-ins (a Communicator extends
#: its registry with them) and every kernel its schedules name (frozen)
SHM_INPLACE_OWN_KERNELS: dict[str, Any] = {SHM_PUSH: _k_push}
SHM_INPLACE_KERNELS: KernelRegistry = BUILTIN_KERNELS.extended(SHM_INPLACE_OWN_KERNELS).freeze()


def _check(op: str, count: int) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")


def _commit(s: Schedule, count: int, wire: str, op: str, algorithm: str,
            kernels: KernelRegistry | None = None) -> Schedule:
    s.meta["collectives"] = [{"kind": "allreduce", "count": count, "dtype": wire, "op": op,
                              "algorithm": algorithm}]
    return s.commit() if kernels is None else s.commit(kernels=kernels)


def _embed(s: Schedule, members: Sequence[int], after: int,
           build: Callable[[Schedule], int]) -> int:
    """Append to ``s`` the collective ``build(sub)`` appends to a schedule of the group
    ``members`` (this rank's index in it, their count), its peers mapped to ranks, its start
    after op ``after``; return its result op. Slots and scratch the builder declares are
    declared in ``s`` too."""
    sub = Schedule(members.index(s.rank), len(members))
    for name, spec in s.slots.items():
        sub.declare(name, spec)
    done = build(sub)
    base = len(s.ops)
    for op in sub.ops:
        deps = tuple(base + d for d in op.deps)
        k = op.k
        if not op.deps and op.kind == "nop":  # the builder's start: after ``after``
            deps, k = (after,), 1
        s.add(dataclasses.replace(
            op, deps=deps, k=k, peer=members[op.peer] if op.peer >= 0 else op.peer,
            payload_from=base + op.payload_from if op.payload_from >= 0 else -1,
            recvs=tuple(base + i for i in op.recvs)))
    for name, spec in sub.slots.items():
        if name not in s.slots:
            s.declare(name, spec)
    for name, n in sub.meta.get("scratch", {}).items():
        s.meta.setdefault("scratch", {})[name] = n
    return base + done
