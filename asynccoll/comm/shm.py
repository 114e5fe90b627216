"""Shared-memory segments: their names, creation, mapping and lifetime (the runtime of the
schedules :mod:`asynccoll.collectives.shm` builds).

Every rank owns a segment (a file in :data:`SHM_DIR` that every rank maps) per schedule; the
schedules bind them to the slots ``mine`` and ``peer{q}``.

**Names.** A segment's name is ``asynccoll-{uid}-{tag}-{hash}`` (:func:`segment_path`): the
job's public tag (:func:`job_tag`: ``ASYNCCOLL_JOB_TAG``, which ``asynccoll run`` sets for its
ranks, else derived from the job's token), then a keyed hash of the schedule id, the rank and
the part under the job's segment token (63 random bits drawn by rank 0 at first use and sent
to the peers only over the job's connections). A listing of :data:`SHM_DIR` thus reveals the
tag, which a launcher cleans up by, and no future name: another local user cannot pre-create
a name the job will ask for (and a name taken anyway makes the route fall back to the network).

**Cleanup, whatever dies when.** Each owner unlinks its segments as soon as every peer has
mapped them (below); before that they are removed by whoever outlives their owner: the
survivors of a lost rank (:meth:`PartialSegments.forget`, the dense setup's), a rank's own
``SIGTERM`` handler (:func:`install_cleanup`, installed by :func:`~asynccoll.connect` where
``SIGTERM`` has its default disposition: it unlinks this process's segments, then dies of the
signal as it would have), and ``asynccoll run``, which unlinks every file with its job's tag
(:func:`unlink_job`) when the job ends, however it ends (the ranks exit or fail, the launcher
gets ``SIGTERM``, ``SIGINT`` or ``SIGHUP``). A launcher killed with ``SIGKILL`` cannot: its
ranks die with it instead (``PR_SET_PDEATHSIG`` sends them ``SIGTERM``) and, finding their
launcher gone, unlink the whole job's files themselves.

**Safety.** Segments are created with ``O_EXCL``, ``O_NOFOLLOW`` and mode 0600, so two jobs on
one host never share one. A rank maps its peers' segments read-only (writable for the arrays of
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

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import secrets
import signal
import socket
import stat
import sys
import threading
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: how long a rank that found a peer's segment gone waits for the loss that explains it
#: (:meth:`PartialSegments.attach_or_wait`) before it fails with the missing segment
GONE_GRACE = 5.0

__all__ = ["GONE_GRACE", "JOB_TAG_ENV", "SHM_DIR", "PartialSegments", "Segment", "check_tag",
           "host_hash", "host_id", "install_cleanup", "job_prefix", "job_tag", "new_job_tag",
           "new_token", "segment_path", "unlink_job"]

#: where segments live: a tmpfs, ``/dev/shm`` unless ``ASYNCCOLL_SHM_DIR`` names another
#: directory (read once, at import; tests give each job a private one to count what is left)
SHM_DIR = os.environ.get("ASYNCCOLL_SHM_DIR") or "/dev/shm"
#: the variable that gives a job's segments their public tag (``asynccoll run`` sets it for
#: its ranks, equal on every node; set by hand, it must be equal on the ranks of a host)
JOB_TAG_ENV = "ASYNCCOLL_JOB_TAG"
_ENV_TAG = os.environ.get(JOB_TAG_ENV, "").strip()  # read once, at import
_TAG_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
#: the paths of the segments this process created and has not unlinked: what its SIGTERM
#: handler unlinks. Process-wide on purpose: a signal handler reaches no communicator, and the
#: files are the process's whichever communicator made them.
_OWN: set[str] = set()
#: held while a segment is created and registered, and by the SIGTERM handler while it takes
#: the list (so that no thread creates one it misses); reentrant, since the handler runs on
#: the main thread, which may hold it; ``_ending`` set: no segment is created any more
_CREATING = threading.RLock()
_ending = threading.Event()
#: the process that installed the SIGTERM handler (a forked child inherits the handler, not
#: the segments) and the launcher it dies with (:func:`install_cleanup`; 0: none)
_installed: list[int] = [0, 0]


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


def new_job_tag() -> str:
    """A random public tag for one job's segments (16 hex digits)."""
    return secrets.token_hex(8)


def check_tag(tag: str) -> str:
    """``tag`` when it can name a job's segments (1 to 32 letters, digits or ``_``: no ``-``,
    so that one job's prefix is never the start of another's), else ``ValueError``."""
    if not 1 <= len(tag) <= 32 or not set(tag) <= _TAG_CHARS:
        raise ValueError(f"a job tag ({JOB_TAG_ENV}) must be 1 to 32 letters, digits or '_', "
                         f"got {tag!r}")
    return tag


def job_tag(token: int) -> str:
    """The public tag of the job whose segment token is ``token``: ``ASYNCCOLL_JOB_TAG`` when
    set (``asynccoll run`` sets it), else a hash of the token (which it does not reveal), so
    equal on every rank either way. Raises ``ValueError`` naming a malformed variable."""
    if _ENV_TAG:
        return check_tag(_ENV_TAG)
    return hashlib.blake2b(_key(token), digest_size=8, person=b"asynccoll.tag").hexdigest()


def job_prefix(tag: str) -> str:
    """The start of the file name of every segment this user's job ``tag`` makes."""
    return f"asynccoll-{os.getuid()}-{check_tag(tag)}-"


def _key(token: int) -> bytes:
    return (token & (2**64 - 1)).to_bytes(8, "little")


def segment_path(token: int, sched_id: int, rank: int, part: int | None = None) -> str:
    """The path of rank ``rank``'s segment for schedule ``sched_id`` of the job ``token``
    (``part``: which of a persistent schedule's alternating segments): the job's prefix
    (:func:`job_prefix` of :func:`job_tag`) and 24 hex digits of a hash keyed by the token,
    which nobody without the token can compute (module doc, "Names")."""
    what = f"{sched_id & (2**64 - 1)}/{rank}/{'' if part is None else part}".encode()
    h = hashlib.blake2b(what, key=_key(token), digest_size=12, person=b"asynccoll.seg")
    return os.path.join(SHM_DIR, job_prefix(job_tag(token)) + h.hexdigest())


def unlink_job(tag: str, directory: str | None = None) -> tuple[int, int]:
    """Unlink every segment of this user's job ``tag`` left in ``directory`` (default
    :data:`SHM_DIR`): regular files with the job's prefix that this user owns. Returns how
    many files and bytes (of memory they held) went. What ``asynccoll run`` does when its job
    ends; costs one listing of the directory."""
    prefix, uid = job_prefix(tag), os.getuid()
    where = directory or SHM_DIR
    try:
        names = [n for n in os.listdir(where) if n.startswith(prefix)]
    except OSError:
        return 0, 0
    files = held = 0
    for name in names:
        path = os.path.join(where, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue  # another user's file under our prefix: not ours to judge
            os.unlink(path)
        except OSError:
            continue
        _OWN.discard(path)
        files, held = files + 1, held + st.st_blocks * 512
    return files, held


def install_cleanup(launcher_pid: int | None = None) -> bool:
    """Make a ``SIGTERM`` unlink this process's own segments before it ends the process (the
    handler then restores the default disposition and sends the signal again, so the process
    still dies of it: its exit status says so). Installed only from the main thread and only
    where ``SIGTERM`` has its default disposition (an application's own handler is left
    alone); returns whether it was. :func:`~asynccoll.connect` calls it.

    ``launcher_pid`` (``asynccoll run`` passes its pid in ``ASYNCCOLL_LAUNCHER_PID``): when it
    is this process's parent, ask the kernel (Linux ``PR_SET_PDEATHSIG``) for a ``SIGTERM``
    when the parent dies, so that ranks do not outlive a launcher killed with ``SIGKILL``;
    their handler, finding the launcher gone, then unlinks every segment of the job's tag
    (``ASYNCCOLL_JOB_TAG``), the files of ranks lost before included, as the launcher would
    have. (A Python handler runs on the main thread only, and never when that thread is
    stuck, e.g. in an exit that waits for a thread the dead job will not release: the
    launcher's reaper, :mod:`asynccoll.launch.reaper`, then kills the rank and unlinks.)"""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed[:] = [os.getpid(), 0]
    if launcher_pid and os.getppid() == launcher_pid and sys.platform.startswith("linux"):
        _installed[1] = launcher_pid
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != launcher_pid:
            os.kill(os.getpid(), signal.SIGTERM)  # (PR_SET_PDEATHSIG) it died meanwhile
    return True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _installed[0]:  # (a forked child, a data-loader worker say, has none)
        _clean_up()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _clean_up() -> None:
    """Unlink this process's segments (none is created afterwards) and, when its launcher is
    gone, every segment of the job's tag."""
    _ending.set()
    locked = _CREATING.acquire(timeout=1.0)  # a thread mid-creation finishes it first
    own = tuple(_OWN)
    if locked:
        _CREATING.release()
    _unlink_paths(own)
    launcher = _installed[1]
    if launcher and os.getppid() != launcher and _ENV_TAG:
        with contextlib.suppress(ValueError):
            unlink_job(_ENV_TAG)  # the launcher is gone: nobody else will


class Segment:
    """A mapped segment: created (and later unlinked) by its owner, attached by its peers."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.owner = owner
        self._mm: mmap.mmap | None = mm

    @classmethod
    def create(cls, path: str, nbytes: int) -> Segment:
        """Create ``path`` (``FileExistsError`` if it exists), ``nbytes`` long, mode 0600."""
        with _CREATING:
            if _ending.is_set():
                raise OSError(errno.ESHUTDOWN, f"not creating {path}: the process is ending")
            _OWN.add(path)  # first: the handler may run between any two lines here
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            except BaseException:
                _OWN.discard(path)
                raise
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
            _unlink_paths([path])
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
        import numpy as np  # not at the top: the launcher and its reaper need no NumPy

        return np.frombuffer(self._mm, dtype, count)

    def unlink(self) -> None:
        """Remove the file (owner only; the mappings stay valid). Idempotent."""
        if self.owner:
            _unlink_paths([self.path])

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
        import numpy as np

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

    def attach_or_wait(self, ex: Any) -> bool:
        """:meth:`attach`, for the ``SHM_ATTACH`` kernel of executor ``ex``. A peer unlinks
        its segments before every peer mapped them only when its execution failed (a loss it
        saw first, its timeout): this rank's cannot complete either, and the loss that failed
        the peer's reaches this rank a moment later, as it reaches every rank. So a segment
        found gone leaves the op pending (:class:`~asynccoll.sched.executor.KernelWaits`):
        the execution fails with that loss, as everywhere else (and with ``survive=True`` the
        survivors go on; a ``FileNotFoundError`` they could not go on from, seen in CI), or,
        after :data:`GONE_GRACE` s without one, with an ``ExecutionError`` naming the
        segment."""
        try:
            return self.attach()
        except FileNotFoundError as exc:  # (imported here: this module stays light, the
            from ..errors import ExecutionError  # launcher's reaper imports it)
            from ..sched.executor import KernelWaits

            e = ex.execution
            err = ExecutionError(
                f"rank {self.rank}: a peer's shared-memory segment {exc.filename} was gone "
                f"before this rank mapped it (the peer's execution {e} failed), and no loss "
                f"was reported within {GONE_GRACE} s")

            def give_up() -> None:
                if ex.execution == e:
                    ex.abort(err)  # (no-op once the loss failed it, or closed)

            asyncio.get_running_loop().call_later(GONE_GRACE, give_up)
            raise KernelWaits(str(exc)) from exc

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


def _unlink_paths(paths: Iterable[str]) -> None:
    """Unlink ``paths``, those gone already or not ours to remove aside."""
    for path in paths:
        _OWN.discard(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
