"""Shared-memory segments: their names, creation, mapping and lifetime (the runtime of the
schedules :mod:`asynccoll.collectives.shm` builds).

Every rank owns a segment (a file in :data:`SHM_DIR` that every rank maps) per schedule; the
schedules bind them to the slots ``mine`` and ``peer{q}``.

**Lifetime and safety.** Segments are created with ``O_EXCL`` and mode 0600, named by user,
job token (drawn by rank 0 at first use), schedule id and rank, so two jobs on one host never
share one. A rank maps its peers' segments read-only (writable for the arrays of
``Communicator.empty``, which the peers write their reduced blocks into) and refuses one that
another user owns,
that others may read or write, or of the wrong size. Once every rank has mapped every segment
(a barrier), each owner unlinks its own: from then on nothing is left in ``/dev/shm`` whatever
happens to the processes, a SIGKILL included; the memory lives as long as a mapping does. A
rank lost mid-call is reported like any other (PeerLostError, over the connections that carry
the wake-ups).

**Partial collectives** (:class:`PartialSegments`): a persistent partial handle's segments
are made without a collective step (this rank's at the handle's creation, a peer's mapped
at the first execution that needs them) and unlinked once every peer has provably mapped them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SHM_DIR", "PartialSegments", "Segment", "host_hash", "host_id", "new_token",
           "segment_path"]

#: where segments live (a tmpfs on Linux)
SHM_DIR = "/dev/shm"


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


def segment_path(token: int, sched_id: int, rank: int, part: int | None = None) -> str:
    """The path of rank ``rank``'s segment for schedule ``sched_id`` of the job ``token``
    (``part``: which of a persistent schedule's alternating segments)."""
    tail = "" if part is None else f".{part}"
    return os.path.join(SHM_DIR, f"asynccoll-{os.getuid()}-{token:016x}-"
                                 f"{sched_id & (2**64 - 1):x}-{rank}{tail}")


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
    def attach(cls, path: str, nbytes: int, writable: bool = False) -> Segment:
        """Map a peer's segment, read-only unless ``writable`` (the arrays of
        :meth:`Communicator.empty <asynccoll.Communicator.empty>`, into which each rank writes
        its reduced block: :func:`~asynccoll.collectives.shm.build_shm_inplace`);
        ``PermissionError`` naming it when another user owns it or others may read or write
        it, ``ValueError`` when its size is not ``nbytes``."""
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"shared-memory segment {path} is owned by uid "
                                      f"{st.st_uid} with mode {st.st_mode & 0o777:o}; refusing "
                                      f"it (expected uid {os.getuid()}, mode 600)")
            if st.st_size != nbytes:
                raise ValueError(f"shared-memory segment {path} has {st.st_size} bytes, "
                                 f"expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable
                                                                else 0))
        finally:
            os.close(fd)
        return cls(path, mm, False)

    def array(self, dtype: Any, count: int) -> np.ndarray[Any, Any]:
        """The segment as ``count`` elements of ``dtype`` (read-only when attached so)."""
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


class PartialSegments:
    """The segments of one shared-memory partial allreduce handle, made without a collective.

    Executions alternate between two sets (part ``e % 2`` for execution ``e``), for the reason
    the dense path alternates two executors (:mod:`asynccoll.collectives.shm`'s doc: rank r
    writes part p again at execution e + 2 only after completing e + 1, which needs every
    peer's "written" of e + 1, sent after that peer completed e and so after its last read of
    r's part p). ``parts=1``:
    one set, for a data phase whose own two rounds make reuse safe (the sparse split allgather
    of :mod:`asynccoll.collectives.sparse.shm`); the handle then binds it once.

    * This rank's segments (one per set) are created here, synchronously, with names every rank can
      derive (:func:`segment_path` of the job ``token``, the handle's schedule id, the rank
      and the part), ``O_EXCL`` and mode 0600 as always.
    * A peer's segments are mapped by :meth:`attach`, which the schedule's
      :data:`~asynccoll.collectives.partial.SHM_ATTACH` op calls once every peer has said
      "written" for an execution: a peer says so only after
      creating its segments (at its handle's creation), so they exist. Until then a peer's
      slot is bound to a placeholder of zeros that nothing reads.
    * :meth:`unlink_own` once every peer has provably mapped this rank's segments: after this
      rank completed execution 1 (each peer then completed execution 0, whose attach mapped
      both parts). :meth:`forget` unlinks a lost peer's by name; :meth:`close` unlinks this
      rank's and unmaps.

    Raises ``OSError`` (ENOSPC naming the fix, EEXIST) when this rank's segments cannot be
    created; :meth:`attach` raises ``PermissionError``/``ValueError`` for a peer segment that
    another user owns, that others may read, or of the wrong size.
    """

    def __init__(self, token: int, sched_id: int, rank: int, world_size: int, count: int,
                 dtype: Any, parts: int = 2) -> None:
        self._token, self._sid, self.rank, self.world_size = token, sched_id, rank, world_size
        if parts not in (1, 2):
            raise ValueError(f"parts must be 1 or 2, got {parts!r}")
        #: how many sets alternate (1: a schedule whose own rounds make reuse safe)
        self.parts = parts
        self.count = count
        self.dtype = np.dtype(dtype)
        self._nbytes = count * self.dtype.itemsize
        self._own: list[Segment] = []
        try:
            for part in range(parts):
                self._own.append(Segment.create(self.path(rank, part), self._nbytes))
        except BaseException:
            for seg in self._own:
                seg.unlink()
                seg.close()
            raise
        # A process that exits without closing its communicator (no ``async with``, or
        # ``sys.exit`` elsewhere) would otherwise leave both files in /dev/shm for good when
        # fewer than two executions ran: unlink them at interpreter exit at the latest (a
        # SIGKILL still leaves them, to the survivors' :meth:`forget`).
        self._unlink_at_exit = weakref.finalize(self, _unlink_paths,
                                                [seg.path for seg in self._own])
        self._own_arrays = [seg.array(self.dtype, count) for seg in self._own]
        self._peer_segs: list[Segment] = []
        self._peer_arrays: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self._missing = [q for q in range(world_size) if q != rank]
        self._placeholder = np.zeros(count, self.dtype)  # untouched pages: no memory taken
        self.unlinked = False

    def path(self, rank: int, part: int) -> str:
        """The path of ``rank``'s segment ``part`` of this handle."""
        return segment_path(self._token, self._sid, rank, part)

    def buffers(self, part: int) -> dict[str, np.ndarray[Any, Any]]:
        """The arrays to bind to ``mine`` and ``peer{q}`` for an execution of ``part`` (modulo
        :attr:`parts`)."""
        part %= self.parts
        out = {"mine": self._own_arrays[part]}
        for q in range(self.world_size):
            if q != self.rank:
                out[f"peer{q}"] = self._peer_arrays.get((q, part), self._placeholder)
        return out

    def attach(self) -> bool:
        """Map every peer segment not mapped yet (read-only, checked as
        :meth:`Segment.attach`); return whether any was. Costs nothing once all are."""
        if not self._missing:
            return False
        for q in self._missing:
            for part in range(self.parts):
                seg = Segment.attach(self.path(q, part), self._nbytes)
                self._peer_segs.append(seg)
                self._peer_arrays[(q, part)] = seg.array(self.dtype, self.count)
        self._missing = []
        return True

    def unlink_own(self) -> None:
        """Unlink this rank's segments (the mappings stay valid). Idempotent."""
        if not self.unlinked:
            self.unlinked = True
            self._unlink_at_exit()  # unlinks them (once), and not again at exit

    def forget(self, rank: int) -> None:
        """Unlink a lost ``rank``'s segments by name (it cannot any more); no error if they
        are gone already."""
        if 0 <= rank < self.world_size and rank != self.rank:
            for part in range(self.parts):
                with contextlib.suppress(OSError):
                    os.unlink(self.path(rank, part))

    def close(self) -> None:
        """Unlink this rank's segments and unmap every segment (each mapping goes with its
        last array)."""
        self.unlink_own()
        self._own_arrays = []
        self._peer_arrays.clear()
        for seg in (*self._own, *self._peer_segs):
            seg.close()


def _unlink_paths(paths: Sequence[str]) -> None:
    """Unlink ``paths``, those gone already or not ours to remove aside."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
