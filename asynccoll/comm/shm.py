"""The allreduce between the ranks of one host, through shared memory (two-shot).

Every rank owns a segment (a file in ``/dev/shm`` that every rank maps); a call, for rank r of
P, with the vector cut into P blocks (``numpy.array_split``'s rule):

1. copy the caller's array into its own segment, then tell every peer (an empty message over
   the communicator's existing connections: the wake-up, no spinning);
2. once told by every peer, reduce block r of all P segments, reading the peers' memory in
   place, into block r of its own segment, then tell every peer again;
3. copy each block q out of the segment of the rank q that reduced it into the caller's array.

Each rank reads every byte once and writes it twice (the copy in, the copy out) plus its block
once: three passes over the vector per rank, where an allreduce over TCP moves it through the
kernel's socket buffers several times. Two messages per peer per call; at small sizes the
recursive-doubling allreduce over the network costs fewer, so the communicator takes this path
only from :data:`SHM_MIN_BYTES` up (or when asked for, ``algorithm="shm"``), and only when every
rank of the communicator is on this host (:func:`host_id`, compared at first use).

**Reuse without a third message.** Calls alternate between two executors with two segments
each: a rank writes into the segment of call n again at call n + 2, and by then every peer has
finished reading it (a peer's "copied in" message of call n + 1 comes after its call n ended).

**Arrays that live in shared memory.** :meth:`Communicator.empty
<asynccoll.Communicator.empty>` (collective) allocates an array in a segment of its own that
every peer maps; ``allreduce(x, out=x)`` of such an array skips the copy in (peers read it
where it is) and reduces it in place (:func:`build_shm_inplace`), at the price of a third
wake-up round.

**Across hosts** (:func:`build_hier_allreduce`): the ranks of each host sum their data through
shared memory as above, the lowest rank of each host (its leader) allreduces the host sums
with the other leaders over the network (the dense schedule of the leaders, chosen by size and
their number), and each leader hands the result to its host's ranks through its segment. Each
byte crosses the network once per host instead of once per rank.

**Lifetime and safety.** Segments are created with ``O_EXCL`` and mode 0600, named by user,
job token (drawn by rank 0 at first use), schedule id and rank, so two jobs on one host never
share one. A rank maps its peers' segments read-only and refuses one that another user owns,
that others may read or write, or of the wrong size. Once every rank has mapped every segment
(a barrier), each owner unlinks its own: from then on nothing is left in ``/dev/shm`` whatever
happens to the processes, a SIGKILL included; the memory lives as long as a mapping does. A
rank lost mid-call is reported like any other (PeerLostError, over the connections that carry
the wake-ups).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..collectives._plan import block_bounds
from ..collectives.dense import REDUCE_OPS, build_allreduce
from ..sched import BufRef, Schedule, SlotSpec

__all__ = ["SHM_DIR", "SHM_MIN_BYTES", "Segment", "build_hier_allreduce", "build_shm_allreduce",
           "build_shm_inplace", "host_groups", "host_hash", "host_id", "new_token",
           "segment_path"]

#: where segments live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
#: the communicator's allreduce takes the shared-memory path from this many bytes up, when
#: every rank is on one host (below it, recursive doubling's fewer messages win)
SHM_MIN_BYTES = 256 << 10

_READY, _REDUCED, _DONE, _FINAL = 0, 1, 2, 3  # the tags of the wake-up rounds
_NET_TAG = 16  # the leaders' network allreduce of a hierarchical schedule starts here


def host_id() -> str:
    """This host's identity: ``ASYNCCOLL_HOST_ID`` when set (tests make several "hosts" on one
    machine with it), else the host name and the kernel's boot id."""
    forced = os.environ.get("ASYNCCOLL_HOST_ID")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_hash() -> int:
    """:func:`host_id` as a non-negative int64 (equal on the ranks of one host)."""
    import hashlib

    d = hashlib.blake2b(host_id().encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1


def new_token() -> int:
    """A random non-negative int64 naming one job's segments."""
    return secrets.randbits(63)


def segment_path(token: int, sched_id: int, rank: int) -> str:
    """The path of rank ``rank``'s segment for schedule ``sched_id`` of the job ``token``."""
    return os.path.join(SHM_DIR,
                        f"asynccoll-{os.getuid()}-{token:016x}-{sched_id & (2**64 - 1):x}-{rank}")


class Segment:
    """A mapped segment: created (and later unlinked) by its owner, attached by its peers."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.owner = owner
        self._mm: mmap.mmap | None = mm

    @classmethod
    def create(cls, path: str, nbytes: int) -> Segment:
        """Create ``path`` (``FileExistsError`` if it exists), ``nbytes`` long, mode 0600."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            # Reserve the pages now: a tmpfs too small for them (a container's default
            # /dev/shm is 64 MB) then fails here, with ENOSPC, instead of killing the process
            # with SIGBUS at the first write.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                free = _free_bytes(os.path.dirname(path))
                raise OSError(exc.errno, f"not enough shared memory for a {nbytes}-byte "
                              f"segment in {os.path.dirname(path)} ({free} bytes free): give "
                              "the container more (--shm-size) or set ASYNCCOLL_SHM=0") from exc
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(path, mm, True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Segment:
        """Map a peer's segment read-only; ``PermissionError`` naming it when another user owns
        it or others may read or write it, ``ValueError`` when its size is not ``nbytes``."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"shared-memory segment {path} is owned by uid "
                                      f"{st.st_uid} with mode {st.st_mode & 0o777:o}; refusing "
                                      f"it (expected uid {os.getuid()}, mode 600)")
            if st.st_size != nbytes:
                raise ValueError(f"shared-memory segment {path} has {st.st_size} bytes, "
                                 f"expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, mm, False)

    def array(self, dtype: Any, count: int) -> np.ndarray[Any, Any]:
        """The segment as ``count`` elements of ``dtype`` (read-only when attached)."""
        assert self._mm is not None
        return np.frombuffer(self._mm, dtype, count)

    def unlink(self) -> None:
        """Remove the file (owner only; the mappings stay valid). Idempotent."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap, once no array of it is left (else the mapping goes with the last one)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # arrays still export it: it is unmapped when they go
                pass


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def build_shm_inplace(rank: int, world_size: int, count: int, dtype: Any,
                      op: str = "sum") -> Schedule:
    """The schedule of an allreduce of an array that already lives in shared memory
    (:meth:`Communicator.empty <asynccoll.Communicator.empty>`): no copy in. Slots ``mine``
    (the caller's array, reduced in place) and ``peer{q}`` (rank q's array of the same
    allocation, read-only). Three wake-up rounds: "written", "reduced", and "copied out" —
    the last because the caller may overwrite its array as soon as the call returns, and a
    peer may still be copying this rank's reduced block out of it until then."""
    _check(op, count)
    P, r = world_size, rank
    wire = np.dtype(dtype).str
    s = Schedule(r, P, name="shm_allreduce_inplace")
    for slot in _segment_slots(r, range(P)).values():
        s.declare(slot, SlotSpec(count, wire))
    start = s.nop(label="start")
    outs = _two_shot(s, range(P), count, op, start, "mine", "written")
    others = [q for q in range(P) if q != r]
    copied = s.nop(deps=outs, label="copied out")
    for q in others:
        s.send(q, None, _DONE, deps=copied, label="copied out")
    done = [s.recv(q, None, _DONE, label="copied out") for q in others]
    s.final = s.nop(deps=[copied, *done], label="final")
    return _commit(s, count, wire, op, "shm-inplace")


def build_shm_allreduce(rank: int, world_size: int, count: int, dtype: Any,
                        op: str = "sum") -> Schedule:
    """The committed schedule of rank ``rank`` (module doc). Slots: ``data`` (the caller's
    array, reduced in place), ``mine`` (this rank's segment), ``peer{q}`` (rank q's segment,
    read-only), ``count`` elements of ``dtype`` each. Raises ``ValueError`` naming a bad
    ``op`` or ``count``."""
    _check(op, count)
    P, r = world_size, rank
    wire = np.dtype(dtype).str
    s = Schedule(r, P, name="shm_allreduce")
    for slot in ("data", *_segment_slots(r, range(P)).values()):
        s.declare(slot, SlotSpec(count, wire))
    copied = s.compute("copy", ["data"], "mine", label="copy in")
    outs = _two_shot(s, range(P), count, op, copied, "data", "copied in")
    s.final = s.nop(deps=outs, label="final")
    return _commit(s, count, wire, op, "shm")


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
        copied = s.compute("copy", ["data"], "mine", deps=start, label="copy in")
        host_done = s.nop(deps=_two_shot(s, g, count, op, copied, "data", "copied in"),
                          label="host sum")
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


def _two_shot(s: Schedule, group: Sequence[int], count: int, op: str, after: int, into: str,
              said: str) -> list[int]:
    """Append the two-shot sum over the segments of ``group`` (this rank among them) once op
    ``after`` has the data in ``mine``: tell the peers (label ``said``), reduce this rank's
    block of every segment into ``mine``, tell them again, copy every block into slot
    ``into`` (this rank's own only when ``into`` is not ``mine``). Returns the ops whose
    completion means ``into`` holds the sum."""
    r = s.rank
    i = list(group).index(r)
    seg = _segment_slots(r, group)
    others = [q for q in group if q != r]
    b = block_bounds(count, len(group))
    for q in others:
        s.send(q, None, _READY, deps=after, label=said)
    ready = [s.recv(q, None, _READY, label=said) for q in others]
    mine = BufRef("mine", b[i], b[i + 1] - b[i])
    reduced = after if not others else s.compute(
        op, [mine, *(BufRef(seg[q], b[i], b[i + 1] - b[i]) for q in others)], mine,
        deps=[after, *ready], label=f"reduce block {i}")
    for q in others:
        s.send(q, None, _REDUCED, deps=reduced, label="reduced")
    outs = [reduced if into == "mine" else s.compute(
        "copy", [mine], BufRef(into, b[i], b[i + 1] - b[i]), deps=reduced,
        label=f"copy out block {i}")]
    for j, q in enumerate(group):
        if q == r:
            continue
        got = s.recv(q, None, _REDUCED, label="reduced")
        lo, n = b[j], b[j + 1] - b[j]
        outs.append(s.compute("copy", [BufRef(seg[q], lo, n)], BufRef(into, lo, n),
                              deps=[got, reduced], label=f"copy out block {j}"))
    return outs


def _check(op: str, count: int) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")


def _commit(s: Schedule, count: int, wire: str, op: str, algorithm: str) -> Schedule:
    s.meta["collectives"] = [{"kind": "allreduce", "count": count, "dtype": wire, "op": op,
                              "algorithm": algorithm}]
    return s.commit()


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
