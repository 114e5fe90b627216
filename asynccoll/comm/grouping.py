"""Sub-communicators and shrinking: ``split``, ``group``, ``shrink`` (DESIGN §6, §10).

:class:`Grouping` is a part of the communicator's class, in a module of its own for size:
groups share their parent's connections (:class:`~.groups.GroupTransport`), inherit its host
layout and switches, and learn the losses it learned before they were made.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import numpy as np

from ..errors import CollectiveTimeoutError, PeerLostError, TransportClosedError
from ..sched import KernelRegistry, TraceWriter
from ..transport.base import Transport
from . import groups
from .dense import DenseOps
from .membership import Membership
from .progress import ProgressEngine
from .route import Switches

__all__ = ["Grouping", "members_hash"]

log = logging.getLogger("asynccoll.comm")
T = TypeVar("T")
G = TypeVar("G", bound="Grouping")


class Grouping:
    """The communicator's sub-communicators (module doc)."""

    transport: Transport
    timeout: float | None
    survive: bool
    kernels: KernelRegistry
    stall_warn: float | None
    close_timeout: float
    clock_offset: float
    membership: Membership
    _engine: ProgressEngine
    _dense: DenseOps
    _writer: TraceWriter | None
    _trace: str | None
    _closed: bool
    _children: list[Any]
    _groups_made: int
    _group_key: str
    _shrunk: Any
    _parent: Any
    _closes_parent: bool
    #: whether this process took a lost rank's place in a running job (``connect()`` in a
    #: process restarted by ``asynccoll run --max-restarts``): its training classes receive
    #: the state from the members before they contribute (:mod:`.joining`)
    joined: bool = False
    #: called once, on the runtime's loop, with a line that says how this process was taken
    #: back, when its first admission ends, or (``ended``) why it was not, the job having ended
    #: first (a restarted process under ``asynccoll run``: the launcher prints it,
    #: :mod:`asynccoll.launch.joined`); returns the report's future
    joined_report: Callable[[str, bool], Any] | None = None

    @property
    def rank(self) -> int:
        """This process's rank, 0..size-1."""
        return self.transport.rank

    @property
    def size(self) -> int:
        """The world size P."""
        return self.transport.world_size

    @property
    def switches(self) -> Switches:
        """The environment's say in this communicator's routes (``ASYNCCOLL_SHM``,
        ``ASYNCCOLL_CMA``, ``ASYNCCOLL_JOIN_RING_MIN``), read once when the job's communicator
        was made (:class:`~.route.Switches`); groups share it."""
        return self._dense.router.switches

    @property
    def hosts(self) -> list[list[int]]:
        """The ranks of each host, this communicator's ranks, hosts in the order of their
        lowest rank (its leader, ``hosts[i][0]``, the rank the hierarchical collectives cross
        the network from); learned at connect (every rank's host identity: host name and
        boot id, or ``ASYNCCOLL_HOST_ID``), inherited by groups; ``[]`` where it is not known
        (a communicator made without :func:`~asynccoll.connect` before its first shared-memory
        collective)."""
        layout = self._dense.layout
        return [] if layout is None else layout.groups

    # the communicator's own (this class is a part of it)
    def _check_open(self) -> None:
        raise NotImplementedError

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    async def allgather(self, x: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def _make_group(self: G, members: list[int], key: str) -> G:
        raise NotImplementedError

    # -- groups (sub-communicators) and shrinking ---------------------------------------------
    async def split(self: G, color: int | str | None, key: int | None = None,
                    timeout: float | None = None) -> G | None:
        """A sub-communicator of the ranks that pass the same ``color`` (``MPI_Comm_split``).

        Collective over this communicator: every rank calls it, in the same order among its
        collectives. ``color``: an int >= 0; ``"host"`` for the ranks of this host (its
        identity as the shared-memory path sees it, ``ASYNCCOLL_HOST_ID`` included: MPI's
        ``Comm_split_type(SHARED)``); or ``None`` to take part without joining any group
        (MPI's ``UNDEFINED``; returns ``None``). Ranks in the new group are ordered by ``key``
        (default: this rank), ties by this communicator's rank. The group shares this
        communicator's connections (:mod:`asynccoll.comm.groups`); it costs one allgather of
        two integers. Close it with ``await group.close()`` (collective over the group), or
        let this communicator's ``close`` close it first.
        """
        self._check_open()
        if color == "host":
            from .shm import host_hash
            c = host_hash()
        elif color is None:
            c = -1
        elif isinstance(color, bool) or not isinstance(color, (int, np.integer)) \
                or not 0 <= color < 1 << 63:
            raise ValueError(f"color must be an int in 0..2**63-1, 'host' or None, got "
                             f"{color!r}")
        else:
            c = int(color)
        if key is None:
            key = self.rank
        elif isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"key must be an int or None, got {key!r}")
        elif not -(1 << 63) <= key < 1 << 63:
            raise ValueError(f"key must fit in int64, got {key!r}")
        got = await self.allgather(np.array([c, int(key)], np.int64), timeout)
        colors, keys = got[:, 0].tolist(), got[:, 1].tolist()
        n = self._groups_made
        self._groups_made += 1
        if c < 0:
            return None
        members = groups.split_members(colors, keys, c)
        return self._make_group(members, f"{self._group_key}/{n}:{c}")

    async def group(self: G, ranks: Any, timeout: float | None = None) -> G | None:
        """A sub-communicator of ``ranks`` (this communicator's ranks; group rank i is
        ``ranks[i]``), as ``torch.distributed.new_group(ranks)`` and Horovod's process sets.

        Collective over this communicator: every rank calls it with the same ``ranks``, in the
        same order among its collectives; ranks outside the group get ``None``. Ranks that pass
        different ``ranks`` all get a ``ValueError`` (one allgather of a hash compares them).
        Raises ``ValueError``/``TypeError`` naming ``ranks`` when they are not distinct ranks.
        """
        self._check_open()
        members = groups.group_members(ranks, self.size)
        digest = members_hash(members)
        got = await self.allgather(np.array([digest], np.int64), timeout)
        n = self._groups_made
        self._groups_made += 1
        if len(set(got[:, 0].tolist())) != 1:
            differ = sorted(r for r in range(self.size) if int(got[r, 0]) != digest)
            raise ValueError(f"ranks: the ranks passed different groups to group() (ranks "
                             f"{differ} differ from rank {self.rank}'s {members})")
        if self.rank not in members:
            return None
        return self._make_group(members, f"{self._group_key}/{n}:{digest}")

    async def shrink(self: G, timeout: float | None = None) -> G:
        """A communicator of the ranks not lost (MPI ULFM's ``MPIX_Comm_shrink``).

        After a :class:`~asynccoll.PeerLostError`, every survivor calls it; they agree on the
        set of lost ranks (the same set on every survivor, even when several ranks died at once
        or a survivor comes late: :meth:`Membership.agree <.membership.Membership.agree>`) and
        each gets a new communicator of the others, ranked in their old order, over the
        connections that remain. Returns the same communicator when called again. Raises
        :class:`~asynccoll.PeerLostError` when the survivors decided that this rank is lost,
        :class:`~asynccoll.CollectiveTimeoutError` after ``timeout`` seconds (default: the
        communicator's timeout).
        """
        if self._closed:
            raise TransportClosedError("communicator is closed")
        if self._shrunk is not None and not self._shrunk.closed:
            return cast(G, self._shrunk)
        wait = self.timeout if timeout is None else timeout

        async def agree() -> frozenset[int]:
            try:
                return await asyncio.wait_for(self.membership.agree(), wait)
            except asyncio.TimeoutError:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the survivors did not agree within {wait} s "
                    f"(lost so far: {sorted(self.membership.gone)})") from None

        lost = await self._run(agree())
        if self.rank in lost:
            raise PeerLostError(self.rank, "the survivors decided this rank is lost")
        if self._shrunk is not None and not self._shrunk.closed:
            return cast(G, self._shrunk)  # another task's shrink() made it meanwhile
        members = [r for r in range(self.size) if r not in lost]
        self._groups_made += 1
        # The key from agreed data only: a loss can leave the survivors with different counts
        # of groups made (a split that completed on some of them), never with different lost
        # sets.
        shrunk = self._make_group(
            members, f"{self._group_key}/shrink:{members_hash(sorted(lost))}")
        self._shrunk = shrunk
        log.info("rank %d: shrunk to %d ranks (lost %s); rank %d of the new communicator",
                 self.rank, len(members), sorted(lost), shrunk.rank)
        return shrunk

    def report_joined(self, text: str, ended: bool = False) -> Any:
        """The first time: hand ``text`` (how this restarted process was taken back; with
        ``ended``, why it was not) to :attr:`joined_report`, on the runtime's loop, and return
        the report's future there; later, or without one, nothing (None)."""
        report, self.joined_report = self.joined_report, None
        if report is None:
            return None
        return self.in_runtime(lambda: report(text, ended))

    def in_runtime(self, fn: Callable[[], T]) -> T:
        """Run the plain function ``fn`` on the runtime's loop (for objects bound to it:
        futures of the transport, handles' membership side) and return what it returns; from
        another thread it blocks until the loop has run it. Works while ranks are lost (the
        joining protocol runs then)."""
        if self._closed:
            raise TransportClosedError("communicator is closed")
        return self._engine.call(fn)

    async def on_runtime(self, fn: Callable[[], T]) -> T:
        """:meth:`in_runtime`, for coroutines."""
        return self.in_runtime(fn)

    async def run_on_runtime(self, make: Callable[[], Coroutine[Any, Any, T]],
                             timeout: float | None) -> T:
        """Await the coroutine ``make()`` on the runtime's loop, at most ``timeout`` seconds
        (``asyncio.TimeoutError`` after; ``None``: no limit)."""

        async def bounded() -> T:
            return await asyncio.wait_for(make(), timeout)

        return await self._run(bounded())

    @property
    def job(self: G) -> G:
        """The job's communicator (the outermost one: this one, unless it is a group)."""
        c = self
        while c._parent is not None:
            c = c._parent
        return c

    def rejoined_group(self: G, members: list[int], key: str) -> G:
        """A communicator of the job's ranks ``members`` (sorted, this rank among them) keyed
        ``key``, made without a collective: every member calls it with the same arguments at
        the same point of the joining protocol (:mod:`.joining`), a process that took a lost
        rank's place among them. Call it on the job's communicator (:attr:`job`). Its data
        paths are the network's: the host layout of a process that took a lost rank's place
        is not known to the others (the next start of the job sets shared memory up again)."""
        if self._parent is not None:
            raise ValueError("rejoined_group() is made from the job's communicator")
        if self.rank not in members or sorted(set(members)) != list(members):
            raise ValueError(f"members must be sorted distinct ranks with rank {self.rank}, "
                             f"got {members}")
        self._groups_made += 1
        child = self._make_group(list(members), f"{self._group_key}/{key}")
        child._dense.layout = None  # noqa: SLF001 - a communicator of its own class
        # A member this rank already knows lost (a joiner killed while it was taken back)
        # is lost in the new group too: the group learns its parent's losses only from its
        # creation on, and would wait on that rank (its handles start their recovery as they
        # follow it: PartialAllreduce.grow)
        for g, r in enumerate(members):
            if r in self.membership.gone:
                child.membership.learn(PeerLostError(g, f"rank {r} of the parent was lost "
                                                        "before this group was made"), tell=False)
        return child

    def first_world(self: G, size: int) -> G:
        """The communicator of the job's ranks ``0..size-1``, made without a collective, on
        the job's communicator of a job that may grow (:func:`asynccoll.connect`: the ranks
        above are vacant). Its ranks are the job's; it knows the host layout as a group does;
        closing it closes the job's communicator too (the caller holds only this one)."""
        if self._parent is not None or not 0 < size <= self.size or self.rank >= size:
            raise ValueError(f"first_world({size}) is made from the job's communicator, with "
                             f"this rank ({self.rank}) among its ranks")
        self._groups_made += 1
        child = self._make_group(list(range(size)), f"{self._group_key}/first")
        child._closes_parent = True  # noqa: SLF001 - a communicator of its own class
        return child

    @property
    def is_first_world(self) -> bool:
        """Whether this is the first world of a job that may grow (:meth:`first_world`): its
        ranks are the job's, and the job's ranks above them were vacant at the start."""
        return self._closes_parent

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the job (the outermost communicator) that make up this communicator,
        in rank order: ``range(size)`` for the job itself, the members of a group else."""
        t = self.transport
        chain = []
        while isinstance(t, groups.GroupTransport):
            chain.append(t.members)
            t = t.parent
        out = tuple(range(t.world_size))
        for m in reversed(chain):
            out = tuple(out[r] for r in m)
        return out


def members_hash(members: list[int]) -> int:
    """A non-negative int64 hash of a list of ranks (equal lists, equal hashes)."""
    d = hashlib.blake2b(np.asarray(members, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1
