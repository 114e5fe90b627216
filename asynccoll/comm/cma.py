"""The single-copy allreduce between the ranks of one host: each rank reads its peers' arrays.

The two-shot allreduce of :mod:`.shm` copies the caller's array into a shared segment so that
the peers can read it: at P = 4 and 16 MiB that is 12 MiB written and read back per rank, the
copy the arrays of :meth:`Communicator.empty <asynccoll.Communicator.empty>` avoid, and the
difference between the two (0.56-0.70x against 0.82-1.10x Open MPI's speed here; FACTS and
docs/benchmarks.md). Linux's cross-memory attach (``process_vm_readv``, "CMA", what Open MPI's
shared-memory transport uses for large messages) lets a process read another one's memory
directly (``process_vm_writev``: write into it), so the caller's array needs no segment at
all. For rank r of P, its block r (``numpy.array_split``'s bounds):

1. **address**: r sends every peer the address of the caller's array (8 bytes; the peers'
   process ids were exchanged once, at setup, and a rank reads and writes only in those
   processes);
2. **reduce and push**: once every peer's address is in, r reduces block r of every peer's
   array into block r of its own, in pieces of :data:`CMA_PIECE` bytes: each piece read from
   each peer into a small scratch buffer (it stays in the caches) and added at once, own
   block first, then the peers in rank order (the order of the two-shot of :mod:`.shm`: the
   same bits); then, while it is still in the caches, the reduced piece is written into the
   same place of every peer's array. Nobody else reads a peer's block r (only r reduces it,
   and r has read that piece already), so r waits for no one before writing;
3. r tells every peer "written" once its whole block is;
4. r returns once every peer told it "written": its array holds every reduced block, and no
   peer will read or write it any more (each peer q read r's block q before writing it).

Two wake-up rounds (the two-shot over segments needs two, with copies in and out; its
variant for ``comm.empty`` arrays three), and each rank moves (P - 1) / P of the vector twice,
through the kernel, with no copy in. One executor serves every call: a call cannot start
before every peer has finished writing into this rank's array for the previous one.

**When.** Only between processes that may read each other (same user; a kernel whose Yama
``ptrace_scope`` is above 0 refuses unless the target allows it, and so do some container
seccomp profiles): the communicator probes once (every rank reads a random marker out of every
peer and writes it back; a collective flag) and falls back to the two-shot over segments when
one rank cannot. ``ASYNCCOLL_CMA=0`` turns it off. It never weakens the kernel's policy (no
``prctl(PR_SET_PTRACER)``): where it is refused, nothing changes. Reads and writes are bounded
by the caller's own array (a peer's address only says where to read and write in *that* peer: a
peer that lies can only corrupt itself, and a bad address fails the call with ``EFAULT``), and
a peer's death mid-call is a ``PeerLostError``, from the read or write (its process is gone) or
from the connections, whichever comes first.

**A call abandoned mid-way** (a timeout, a cancellation, an error) is where writing into a
peer's memory needs care: the peers may still read this rank's array, or write their blocks
into it, until they notice (a peer's reduce, once started, reads and writes its whole block
whatever happens meanwhile). Such an array is kept alive for the life of the process
(:func:`hold`), closing the communicator included: a live peer mid-reduce still writes into it
after this rank closed, and freed memory would be reused by the next allocation (seen: the
peer's block written over an unrelated new array, the peer completing with the new array's
values in its result). Its contents are undefined, as after any failed in-place collective. A
peer cannot complete on it when this rank gave up before its reduce (it never said "written";
tested); when it gave up after, a peer may still complete, on what the array holds when that
peer reads it: do not change it (or retry a call on it) until the peers have failed or done.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..buffers import REDUCE_OPS
from ..collectives._plan import block_bounds
from ..errors import PeerLostError
from ..sched import BUILTIN_KERNELS, BufRef, KernelRegistry, Schedule, SlotSpec

__all__ = ["CMA_KERNELS", "CMA_MIN_BLOCK", "CMA_OWN_KERNELS", "CMA_PIECE", "address",
           "build_cma_allreduce", "cma_enabled", "cma_size", "hold", "read_remote",
           "write_remote"]

#: bytes of each piece of the reduce (read from each peer into scratch and added, then written
#: into every peer): measured at P = 4, 16 MiB (alternated, 2026-11-24): 1 MiB pieces 8.2-10.2
#: ms per call, 512 KiB 9.3-10.4, 256 KiB 10.1-10.9, 2 MiB 8.5-10.5, 4 MiB 10.3-11.9: large
#: enough that the per-piece system calls and ufunc calls stay small, small enough that the
#: piece and its scratch stay in the caches (1 MiB of L2 per core here, 32 MiB of L3)
CMA_PIECE = 1 << 20

#: the default allreduce takes this path from this many bytes per rank's block (the message
#: over P) up, at two-shot's sizes. Below it two-shot through segments was faster: P = 4 at
#: 4 MiB (1 MiB blocks) 0.37-0.46x Open MPI's speed against 0.46-0.58x, P = 8 at 4 MiB
#: 0.39-0.40x against 0.48-0.60x; even at P = 4, 8 MiB; faster from there (P = 8, 16 MiB:
#: 0.85-0.87x against 0.56-0.74x). Small blocks pay the pinning of 4 KiB pages, where large
#: NumPy arrays get transparent huge pages (reading 16 MiB: 1.4 ms from huge pages, 3.4 ms
#: from small ones).
CMA_MIN_BLOCK = 2 << 20

_ADDRESS, _WRITTEN = 0, 1  # the tags of the two rounds


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str) -> Any:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv, _writev = _load("process_vm_readv"), _load("process_vm_writev")


def cma_enabled() -> bool:
    """Whether this platform has ``process_vm_readv`` and ``process_vm_writev`` (whether
    ``ASYNCCOLL_CMA`` lets the communicator try them is :mod:`.route`'s to say, and whether
    the peers allow it its probe's)."""
    return _readv is not None and _writev is not None


#: what :func:`hold` keeps: never released (module doc, "A call abandoned mid-way")
_HELD: list[Any] = []


def hold(a: Any) -> None:
    """Keep ``a`` (an array peers may still read or write: a failed call's, a probe's marker)
    alive until the process exits. Not until the communicator closes: a peer's reduce under way
    goes on writing into it after that, and the memory, freed, would be some new object's."""
    _HELD.append(a)


def cma_size(nbytes: int, world_size: int) -> bool:
    """Whether a message of ``nbytes`` among ``world_size`` ranks is large enough for this
    path (:data:`CMA_MIN_BLOCK` per block; the same answer on every rank)."""
    return nbytes >= CMA_MIN_BLOCK * world_size


def read_remote(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to address ``local`` of this
    one. Raises ``OSError`` (``ProcessLookupError``: no such process; EPERM: not allowed;
    EFAULT: a bad address) or ``RuntimeError`` when this platform cannot."""
    _move(_readv, "reading", pid, remote, local, nbytes)


def write_remote(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``local`` of this process to address ``remote`` of process
    ``pid``; errors as :func:`read_remote`'s."""
    _move(_writev, "writing", pid, remote, local, nbytes)


def _move(fn: Any, what: str, pid: int, remote: int, local: int, nbytes: int) -> None:
    if fn is None:
        raise RuntimeError("process_vm_readv/writev are not available on this platform")
    lv, rv = _IoVec(local, nbytes), _IoVec(remote, nbytes)
    while rv.len:
        n = fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else errno.EFAULT
            raise OSError(err, f"{what} {nbytes} bytes of process {pid}: {os.strerror(err)}")
        # a partial transfer (a page it could not cross at once): go on from there
        lv.base += n
        lv.len -= n
        rv.base += n
        rv.len -= n


def _peer(peer: int, pid: int, fn: Any, remote: int, local: int, nbytes: int) -> None:
    """``fn`` (:func:`read_remote` or :func:`write_remote`) with rank ``peer``: its process
    gone is that rank lost, as the connections would report it a moment later."""
    try:
        fn(pid, remote, local, nbytes)
    except ProcessLookupError as exc:
        raise PeerLostError(peer, f"its process {pid} is gone ({exc.strerror})") from exc


def address(a: np.ndarray[Any, Any]) -> int:
    """Where ``a``'s data starts in this process (what a peer reads or writes at)."""
    return int(a.__array_interface__["data"][0])


# -- kernels -----------------------------------------------------------------------------------
def _k_address(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
               msgs: Sequence[Any]) -> None:
    """``out[0]`` = the address of the caller's whole array (``inputs[0]``)."""
    out[0] = address(inputs[0])


def _k_reduce(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
              msgs: Sequence[Any]) -> None:
    """Reduce this rank's block (``out``, in the caller's array) with the same block of each
    peer's array and write the result into theirs, piece by piece (each piece read from every
    peer into scratch and added, then written into every peer while it is in the caches:
    about 12 % faster per call at P = 4, 16 MiB than writing the whole block afterwards).
    ``inputs`` = the scratch piece, then each peer's address slot; ``params``: ``peers`` and
    their ``pids`` (in the order of ``inputs``), ``offset`` (the block's byte offset in every
    array), ``op``."""
    scratch = inputs[0]
    fn = REDUCE_OPS[params["op"]]
    if out.dtype.kind == "b":
        fn = np.logical_or if params["op"] in ("sum", "max") else np.logical_and
    flat = out.reshape(-1)
    per = max(1, len(scratch) // out.itemsize)
    piece = scratch.view(out.dtype)[:per]
    remotes = [int(a[0]) + params["offset"] for a in inputs[1:]]
    peers = list(zip(params["peers"], params["pids"], remotes, strict=True))
    for lo in range(0, flat.size, per):
        mine = flat[lo:lo + per]
        part = piece[:mine.size]
        local, nbytes = address(part), mine.nbytes
        for peer, pid, base in peers:
            _peer(peer, pid, read_remote, base + lo * out.itemsize, local, nbytes)
            fn(mine, part, out=mine)
        at = address(mine)  # the piece reduced, still in the caches: into every peer
        for peer, pid, base in peers:
            _peer(peer, pid, write_remote, base + lo * out.itemsize, at, nbytes)


#: the kernels of :func:`build_cma_allreduce` beside the built-ins
CMA_OWN_KERNELS: dict[str, Any] = {"cma_address": _k_address, "cma_reduce": _k_reduce}
#: every kernel the schedule of :func:`build_cma_allreduce` names (frozen)
CMA_KERNELS: KernelRegistry = BUILTIN_KERNELS.extended(CMA_OWN_KERNELS).freeze()


def build_cma_allreduce(rank: int, world_size: int, count: int, dtype: Any, op: str,
                        pids: Sequence[int]) -> Schedule:
    """The committed schedule of rank ``rank`` (module doc). Slots: ``data`` (the caller's
    array, reduced in place), ``addr`` (one int64: its address, sent to the peers),
    ``addr{q}`` (peer q's), ``cma_piece`` (scratch, :data:`CMA_PIECE` bytes at most).
    ``pids``: every rank's process id. Raises ``ValueError`` naming a bad ``op`` or
    ``count``."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    P, r = world_size, rank
    dt = np.dtype(dtype)
    wire = dt.str
    b = block_bounds(count, P)
    others = [(r + step) % P for step in range(1, P)]  # the rank after r first: spread out
    s = Schedule(r, P, name="cma_allreduce")
    s.declare("data", SlotSpec(count, wire))
    scratch = s.meta.setdefault("scratch", {})
    piece = min(CMA_PIECE, max(1, b[r + 1] - b[r]) * dt.itemsize)
    s.declare("cma_piece", SlotSpec(piece, "|u1"))
    scratch["cma_piece"] = piece
    for slot in ("addr", *(f"addr{q}" for q in others)):
        s.declare(slot, SlotSpec(1, np.dtype(np.int64).str))
        scratch[slot] = 1
    mine = BufRef("data", b[r], b[r + 1] - b[r])
    addr = s.compute("cma_address", ["data"], "addr", label="the array's address")
    for q in others:
        s.send(q, "addr", _ADDRESS, deps=addr, label="address")
    got = [s.recv(q, f"addr{q}", _ADDRESS, label="address") for q in sorted(others)]
    if mine.count:
        ordered = sorted(others)  # the peers in rank order: the two-shot's bits
        reduced = s.compute("cma_reduce", ["cma_piece", *(f"addr{q}" for q in ordered)],
                            mine, deps=[addr, *got], label=f"reduce block {r}",
                            peers=ordered, pids=[int(pids[q]) for q in ordered],
                            offset=b[r] * dt.itemsize, op=op)
    else:
        reduced = s.nop(deps=[addr, *got], label=f"block {r} is empty")
    for q in others:
        s.send(q, None, _WRITTEN, deps=reduced, label="written")
    written = [s.recv(q, None, _WRITTEN, label="written") for q in sorted(others)]
    s.final = s.nop(deps=[reduced, *written], label="final")
    s.meta["collectives"] = [{"kind": "allreduce", "count": count, "dtype": wire, "op": op,
                              "algorithm": "cma"}]
    return s.commit(kernels=CMA_KERNELS)
