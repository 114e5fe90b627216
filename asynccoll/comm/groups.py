"""Sub-communicators: a group of the job's ranks that shares its parent's connections.

``await comm.split(color, key)`` and ``await comm.group(ranks)`` (MPI's ``Comm_split`` and
``Comm_create_group``, torch's ``new_group``, Horovod's process sets) return a
:class:`~asynccoll.Communicator` whose ranks are ``0..len(group)-1``, with its own schedules,
partial handles, trace and membership, over a :class:`GroupTransport`: a view of the parent's
transport that opens no socket.

**The view.** A group rank is translated to the parent's rank on every send and receive, and
every schedule id ``s`` of the group to ``(2 << 60) | h(key, s)``, a 60-bit hash of the group's
key and ``s``: the parent's own ids are below ``1 << 60`` (counters) or at and above ``3 << 60``
(membership channels, named handles), so the group's messages are matched by the parent's
matcher in a space of their own and never meet the parent's or another group's. The key of a
group is its parent's key, the parent's count of groups made so far and the group's members:
the same on every member, different for every group (two splits in a row, or two colors of one
split, get different keys). A lost parent rank that is a member is reported to the group under
its group rank; a non-member's loss does not concern the group.

**Creation is collective over the parent** (every parent rank calls it, in the same order
among the parent's collectives), as ``MPI_Comm_split`` and ``torch.distributed.new_group``
are: one small allgather of (color, key) or of a hash of ``ranks`` (ranks that disagree on
``ranks`` get a ``ValueError`` on every rank instead of a hang). A rank outside the group gets
``None``. Closing a group is collective over the group (its goodbye); the parent's ``close``
closes the groups made from it first.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import PeerLostError, TransportClosedError
from ..transport.base import Transport
from ..transport.frames import Header, Message

__all__ = ["GROUP_SPACE", "GroupTransport", "describe", "group_members", "split_members"]

log = logging.getLogger("asynccoll.comm")

#: the top bits of every translated schedule id (see the module doc)
GROUP_SPACE = 2 << 60
_LOW = (1 << 60) - 1


def split_members(colors: Sequence[int], keys: Sequence[int], color: int) -> list[int]:
    """The parent ranks of the group of ``color``, ordered by (key, parent rank) as
    ``MPI_Comm_split`` orders them."""
    return sorted((r for r, c in enumerate(colors) if c == color), key=lambda r: (keys[r], r))


def group_members(ranks: Any, size: int) -> list[int]:
    """``ranks`` checked: distinct ints in ``0..size-1``, at least one; returned as a list in
    the order given (group rank i is ``ranks[i]``)."""
    try:
        items = list(ranks)
    except TypeError:
        raise TypeError(f"ranks must be a sequence of ints, got {ranks!r}") from None
    if any(isinstance(r, (bool, np.bool_)) for r in items):
        raise TypeError(f"ranks must be ints, got {ranks!r}")
    try:
        out = [operator.index(r) for r in items]  # ints only: 1.7 is no rank
    except TypeError:
        raise TypeError(f"ranks must be a sequence of ints, got {ranks!r}") from None
    if not out:
        raise ValueError("ranks must name at least one rank")
    bad = [r for r in out if not 0 <= r < size]
    if bad:
        raise ValueError(f"ranks: {bad} outside 0..{size - 1}")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks must be distinct, got {out}")
    return out


class GroupTransport(Transport):
    """A view of ``parent`` for the group ``members`` (parent ranks; group rank i is
    ``members[i]``), keyed ``key`` (see the module doc). ``listen``/``connect`` are refused
    (the parent is connected); ``close`` only detaches the view: the parent's connections stay
    open. Shares the parent's matcher and limits, so the bounds on what peers may send hold
    for the job as a whole."""

    scheme = "group"

    def __init__(self, parent: Transport, members: Sequence[int], key: str) -> None:
        me = parent.rank
        if me not in members:
            raise ValueError(f"rank {me} is not in the group {list(members)}")
        super().__init__(list(members).index(me), len(members), limits=parent.limits)
        self.parent = parent
        self.members = tuple(int(m) for m in members)
        self.key = key
        self.matcher = parent.matcher
        self.supports_device = parent.supports_device  # type: ignore[misc]
        self._of: dict[int, int] = {m: i for i, m in enumerate(self.members)}
        self._ids: dict[int, int] = {}
        parent.on_peer_lost(self._on_parent_lost)
        self.incarnation = parent.incarnation

    @property
    def address(self) -> str:
        return f"group:{self.key}@{self.parent.address}"

    @property
    def closed(self) -> bool:
        return self._closed or self.parent.closed

    def parent_rank(self, rank: int) -> int:
        """The parent's rank of group rank ``rank``."""
        return self.members[rank]

    def incarnation_of(self, rank: int) -> int:
        return self.parent.incarnation_of(self.members[rank])

    def group_rank(self, parent_rank: int) -> int | None:
        """The group rank of the parent's ``parent_rank`` (None: not a member)."""
        return self._of.get(parent_rank)

    def sched_id(self, sched: int) -> int:
        """The parent's schedule id of this group's schedule ``sched``."""
        got = self._ids.get(sched)
        if got is None:
            h = hashlib.blake2b(f"{self.key}#{sched}".encode(), digest_size=8).digest()
            got = self._ids[sched] = GROUP_SPACE | (int.from_bytes(h, "little") & _LOW)
        return got

    def _on_parent_lost(self, rank: int, exc: PeerLostError) -> None:
        # The parent failed the receives from ``rank`` in the shared matcher already; tell
        # this group's listeners (its membership), under the group's rank.
        g = self._of.get(rank)
        if g is None or self._closed:
            return
        err = PeerLostError(g, f"{exc.reason} (rank {rank} of the parent)")
        for cb in list(self._loss_listeners):
            try:
                cb(g, err)
            except Exception:  # a listener's bug must not break the parent's transport
                log.exception("rank %d: a group's peer-loss listener failed", self.rank)

    # -- the interface, translated ---------------------------------------------------------
    def post_frame(self, dst: int, kind: int, sched: int, execution: int, tag: int,
                   payload: Any, dtype: str = "", shape: tuple[int, ...] = (),
                   fmt: int = 0) -> asyncio.Future[None]:
        if not 0 <= dst < self.world_size:
            raise ValueError(f"dst must be in 0..{self.world_size - 1}, got {dst}")
        if self._closed:
            self._send_view(payload)  # bad payloads still raise
            return self._refused()
        return self.parent.post_frame(self.members[dst], kind, self.sched_id(sched), execution,
                                      tag, payload, dtype, shape, fmt)

    def post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        if not 0 <= dst < self.world_size:
            raise ValueError(f"dst must be in 0..{self.world_size - 1}, got {dst}")
        if header.src != self.rank:
            raise ValueError(f"header.src must be this rank {self.rank}, got {header.src}")
        if self._closed:
            return self._refused()
        return self.parent.post_send(
            self.members[dst], header._replace(src=self.parent.rank,
                                               sched=self.sched_id(header.sched)), payload)

    def post_recv(self, src: int, sched: int, execution: int, tag: int,
                  buf: Any = None) -> asyncio.Future[Message]:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in 0..{self.world_size - 1}, got {src}")
        if self._closed:
            fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            fut.set_exception(TransportClosedError("group closed"))
            return fut
        return self.parent.post_recv(self.members[src], self.sched_id(sched), execution, tag,
                                     buf)

    def finish(self, sched: int, execution: int) -> int:
        return self.parent.finish(self.sched_id(sched), execution)

    def forget(self, sched: int) -> None:
        self.parent.forget(self.sched_id(sched))
        self._ids.pop(sched, None)

    async def close(self) -> None:
        """Detach the view; the parent's connections stay open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.parent.off_peer_lost(self._on_parent_lost)
        except ValueError:
            pass

    # -- the backend's hooks: a view has none ----------------------------------------------
    async def _listen(self, address: str | None) -> str:
        raise RuntimeError("a group shares its parent's connections; it does not listen")

    async def _connect(self, peers: Mapping[int, str], timeout: float) -> None:
        raise RuntimeError("a group shares its parent's connections; it does not connect")

    def _post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        raise AssertionError("unreachable: post_send is translated")  # pragma: no cover

    async def _close(self) -> None:  # pragma: no cover - close() is overridden
        pass


def describe(members: Sequence[int]) -> str:
    """A short label of a group for names and trace directories."""
    m = list(members)
    if len(m) > 6:
        return f"{m[0]}-{m[-1]}x{len(m)}"
    return "-".join(str(r) for r in m)

