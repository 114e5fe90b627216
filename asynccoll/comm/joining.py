"""Taking a lost rank back: admission at a flush boundary, state striped over the members
(DESIGN §6, §10; docs/groups.md, "Joining").

A process restarted in a lost rank's place (``asynccoll run --max-restarts``) connects to every
member (:meth:`Transport.rejoin <asynccoll.transport.base.Transport.rejoin>`; its
communicator has ``joined`` set). A persistent partial allreduce then takes it back in four
steps, at a point where every member has completed the same executions and holds no
contribution: after a flush, as the training classes' sync events have it.

1. **Ready.** The joiner tells every member that it is ready for the handle ``name``
   (:func:`join`, one empty frame each). A member learns it on its runtime loop
   (:class:`Joiners`), whatever its caller does.
2. **Agreement.** At their next flush boundary the members sum, in a collective they make
   anyway (the sync event's parameter allreduce), a vector with a 1 for each rank ready here:
   the ranks ready on *every* member are admitted, the same set everywhere, without a
   collective of its own (:meth:`Joiners.flags`, :meth:`Joiners.agreed`).
3. **Rebuild.** Every member makes the communicator of the grown membership (keyed by the
   handle's name and the first execution of the new world, so it is new for every admission)
   and grows the handle over it: its execution numbering continues
   (:meth:`PartialAllreduce.grow <.partial_member.MemberSide.grow>`), and the ranks that came
   back are no longer reported lost.
4. **State.** The members stream the state to each joiner in stripes, member ``i`` of ``D``
   the ``i``-th ``1/D`` of every array's bytes, so no member sends it all; the lowest member
   sends a small header first (the new membership, the first execution, the caller's meta data
   such as the global step). The joiner receives the stripes straight into its own arrays. Then
   every rank of the new world compares a 64-bit digest of its state with the others'
   (:func:`digest`, one allgather): replicas are equal to the bit, checked, or every rank
   raises :class:`StateMismatchError` naming the ranks that differ.

The members' pause is the flush boundary they were at anyway, plus the time to send one stripe
and one allgather. The joiner's first contribution goes into the first execution of the new
world. What the lost process held (its send buffer, a snapshot nobody completed) was lost with
it and reported lost at the time (:mod:`.survival`); the joiner starts from nothing.

Host (NumPy) arrays only: device arrays are staged by the caller. A rank lost during the
admission fails it on every rank with :class:`~asynccoll.PeerLostError`, as a loss during any
collective does; the joiner can be restarted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ..errors import AsyncCollError, CollectiveTimeoutError, PeerLostError
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome
from .partial_member import stable_id

__all__ = ["Joiners", "StateMismatchError", "admit", "admit_ready", "digest", "join",
           "join_handle", "stripe"]

log = logging.getLogger("asynccoll.comm")

_READY, _HEADER, _STRIPE = 0, 1, 2  # tags on a handle's joining channel
_NOTHING = memoryview(b"")


class StateMismatchError(AsyncCollError):
    """After a join, the ranks' states differ (their digests do not match)."""


def channel(name: str) -> int:
    """The schedule id of the joining messages of handle ``name`` (on the job's transport)."""
    return stable_id(f"{name}#join", 1)


def stripe(nbytes: int, i: int, d: int) -> slice:
    """The byte range member ``i`` of ``d`` sends of an array of ``nbytes`` bytes."""
    return slice(nbytes * i // d, nbytes * (i + 1) // d)


def digest(arrays: Sequence[Any]) -> int:
    """A 64-bit digest of the bytes of ``arrays`` (host arrays): equal bytes, equal digests;
    a flipped bit anywhere changes it. Vectorised (the wrapping sum and the xor of the 8-byte
    words, the tail and the lengths); a check against replicas that drifted apart, not
    against an adversary. Costs two passes over the state at memory speed."""
    mask = (1 << 64) - 1
    acc = 0x9E3779B97F4A7C15
    for a in arrays:
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        n8 = b.size // 8
        words = b[:n8 * 8].view(np.uint64)
        s = int(np.add.reduce(words, dtype=np.uint64))  # (uint64 sums wrap)
        x = int(np.bitwise_xor.reduce(words)) if n8 else 0
        tail = int.from_bytes(bytes(b[n8 * 8:]), "little")
        acc = (acc * 0x100000001B3 + s) & mask
        acc = ((acc ^ ((x << 1 | tail) & mask)) + b.size) & mask
    return acc >> 1


def _bytes(a: Any) -> Any:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"joining moves host (NumPy) arrays; got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError("joining moves contiguous arrays")
    return a.reshape(-1).view(np.uint8)


class Joiners:
    """The member side of step 1 (module doc) for handle ``name`` of the job communicator
    ``job``: the ranks that came back and said they are ready for it."""

    def __init__(self, job: Any, name: str) -> None:
        self.job = job
        self.name = name
        self.sid = channel(name)
        self._ready: set[int] = set()
        self._asked: set[int] = set()  # ready ranks this member flagged at a sync event
        job.in_runtime(self._listen_all)

    def _listen_all(self) -> None:  # on the runtime's loop
        # Every other rank, member or not: a rank that joins later (and so becomes a member)
        # must hear of a joiner that said it is ready before, or the others wait on it forever.
        self.job.membership.join_listeners.append(self._on_join)
        self.job.membership.listeners.append(self._on_lost)
        for r in range(self.job.size):
            if r != self.job.rank:
                self._listen(r)

    def _listen(self, rank: int) -> None:
        fut = self.job.transport.post_recv(rank, self.sid, 0, _READY)
        fut.add_done_callback(lambda f, r=rank: self._on_ready(r, f))

    def _on_lost(self, rank: int) -> None:  # on the runtime's loop
        self._ready.discard(rank)  # lost again before it was taken back
        self._asked.clear()  # the members changed: ask again for the ranks still ready

    def _on_join(self, rank: int) -> None:  # on the runtime's loop
        self._ready.discard(rank)  # an earlier process in its place said so, not this one
        self._asked.discard(rank)
        self._listen(rank)  # (the loss failed the receive posted for the earlier one)

    def _on_ready(self, rank: int, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._ready.add(rank)
            self._listen(rank)  # a joiner says it again to each rank that joins after it

    def _candidates(self, members: Sequence[int]) -> list[int]:
        # Not a rank this member knows lost: a loss notice can reach a member after the
        # rank's new process connected to it (and said it is ready); admitted by the members
        # that do not know it lost, it would be lost to the grown world here only, and they
        # would wait on it. So every member must see it live and ready.
        gone = self.job.membership.gone
        return [r for r in set(self._ready) if r not in members and r not in gone]

    def waiting(self, members: Sequence[int]) -> bool:
        """Whether a rank outside ``members`` (the job's ranks training now) is ready and
        this member has not yet flagged it at a sync event (:meth:`flags`): one event per
        rank ready, not one per step while another member has yet to hear it is ready (that
        member triggers the next); asked again after a loss."""
        return any(r not in self._asked for r in self._candidates(members))

    def flags(self, members: Sequence[int]) -> Any:
        """A float vector of the job's size: 1 for each rank outside ``members`` ready here
        and not known lost (summed over the members by the caller's collective)."""
        out = np.zeros(self.job.size, np.float64)
        for r in self._candidates(members):
            out[r] = 1.0
            self._asked.add(r)
        return out

    def agreed(self, summed: Any, members: Sequence[int]) -> list[int]:
        """The ranks admitted: ready on every one of ``members`` (``summed``: :meth:`flags`
        summed over them)."""
        n = len(members)
        got = [r for r in range(self.job.size) if r not in members and summed[r] >= n]
        for r in got:
            self._ready.discard(r)
            self._asked.discard(r)
        return got


async def admit(h: Any, now: Any, joiners: list[int], state: Sequence[Any],
                meta: dict[str, Any] | None = None) -> Any:
    """Steps 3 and 4 (module doc) on a member: every member of ``now`` (the communicator the
    handle ``h`` runs on) calls it at the same flush boundary with the same ``joiners``.
    ``state``: the arrays every joiner receives (equal on every member: the caller made them
    so); ``meta``: small msgpack-able data for the joiners (the lowest member's is sent).
    Returns the grown communicator, which the handle runs on from now on. Raises
    :class:`StateMismatchError` when the digests differ afterwards."""
    job = now.job
    old = list(now.members)
    members = sorted(set(old) | set(joiners))
    first = h.completed + 1
    key = f"join:{h.name}:{first}"
    grown = job.rejoined_group(members, key)
    ranks = [members.index(m) for m in old]
    await job.on_runtime(lambda: h.grow(grown, first, ranks))
    t = job.transport
    sid = channel(h.name)
    views = [_bytes(a) for a in state]
    d, i = len(old), old.index(job.rank)

    def send() -> list[asyncio.Future[None]]:
        futs = []
        for r in joiners:
            if i == 0:
                head = msgpack.packb({"members": members, "key": key, "first": first,
                                      "donors": old, "meta": meta or {},
                                      "sizes": [int(v.size) for v in views]})
                futs.append(t.post_frame(r, int(Kind.DATA), sid, 0, _HEADER, head))
            for j, v in enumerate(views):
                futs.append(t.post_frame(r, int(Kind.DATA), sid, j, _STRIPE,
                                         v[stripe(v.size, i, d)]))
        return futs

    futs = await job.on_runtime(send)
    try:
        await _settled(job, futs, h.timeout, "send the state to the joining ranks")
        await check(grown, state, h.timeout)
    except PeerLostError:
        gone = sorted(r for r in joiners if r in job.membership.gone)
        if not gone:
            raise
        # A joiner lost again while it joined: the grown handle goes on without it (its
        # survival recovers at the next call, as after any loss); the others are taken back.
        log.warning("rank %d: rank(s) %s lost while joining partial allreduce %r; it goes "
                    "on without them", job.rank, gone, h.name)
        return grown
    log.warning("rank %d: partial allreduce %r took rank(s) %s back: %d ranks from execution "
                "%d", job.rank, h.name, joiners, len(members), first)
    return grown


async def join(comm: Any, name: str, state: Sequence[Any],
               timeout: float | None) -> tuple[Any, int, dict[str, Any]]:
    """Steps 1 and 4 (module doc) on the joiner, for the handle ``name``: say ready, receive
    the header and every member's stripe of ``state`` (into ``state``'s own arrays).
    Returns ``(communicator of the new world, its first execution, the meta data)``; the
    caller makes its handle on that communicator and grows it to that execution."""
    job = comm.job
    t = job.transport
    sid = channel(name)
    views = [_bytes(a) for a in state]

    loop_box: list[asyncio.Future[Any]] = []
    heads: list[asyncio.Future[Any]] = []

    def say(r: int) -> None:  # on the runtime's loop: "ready" to r, and its header awaited
        t.post_frame(r, int(Kind.DATA), sid, 0, _READY, _NOTHING
                     ).add_done_callback(ignore_outcome)
        head = t.post_recv(r, sid, 0, _HEADER)
        head.add_done_callback(lambda f: _deliver(loop_box[0], f))
        heads.append(head)

    def ready() -> int:
        loop_box.append(asyncio.get_running_loop().create_future())
        reachable = [r for r in range(job.size) if r != job.rank and not t.matcher.is_lost(r)]
        for r in reachable:
            say(r)
        # a rank that comes back meanwhile (it may be the one that will send the header) hears
        # it too: members that joined after this rank said it would never learn of it
        job.membership.join_listeners.append(say)
        return len(reachable)

    def done() -> None:
        with contextlib.suppress(ValueError):
            job.membership.join_listeners.remove(say)
        for f in heads:
            f.cancel()

    if not await job.on_runtime(ready):
        await job.on_runtime(done)
        raise PeerLostError(job.rank, f"no member of the job is reachable to join {name!r}")
    try:
        got = await _bounded(job, lambda: loop_box[0], timeout,
                             f"be taken back by the members for {name!r}")
    finally:
        await job.on_runtime(done)
    head = msgpack.unpackb(bytes(got.payload))
    members, donors = list(head["members"]), list(head["donors"])
    if [int(v.size) for v in views] != list(head["sizes"]):
        raise ValueError(f"the state given to join {name!r} has byte sizes "
                         f"{[int(v.size) for v in views]}; the members' has {head['sizes']}")

    def receive() -> list[asyncio.Future[Any]]:
        d = len(donors)
        return [t.post_recv(src, sid, j, _STRIPE, v[stripe(v.size, i, d)])
                for i, src in enumerate(donors) for j, v in enumerate(views)]

    futs = await job.on_runtime(receive)
    await _settled(job, futs, timeout, f"receive the state of {name!r}")
    grown = job.rejoined_group(members, str(head["key"]))
    await check(grown, state, timeout)
    log.warning("rank %d: joined partial allreduce %r: %d ranks from execution %d", job.rank,
                name, len(members), int(head["first"]))
    return grown, int(head["first"]), dict(head["meta"])


async def admit_ready(h: Any, watch: Joiners, state: Sequence[Any] = (),
                      meta: dict[str, Any] | None = None,
                      timeout: float | None = None) -> list[int]:
    """The generic member side, for a bare partial handle ``h`` (``survive``) and user state:
    every member calls it at the same point, right after ``await h.flush()`` (the flush
    boundary); one allreduce of the ready flags over the members (``watch``: a
    :class:`Joiners` made for ``h`` when the handle was), then :func:`admit` of the ranks
    ready on every member with ``state`` (arrays equal on every member) and ``meta``. Returns
    the ranks admitted (often none). A rank that joined calls it too from then on, at the
    same points."""
    now = h.communicator
    if now is None:
        raise ValueError(f"partial allreduce {h.name!r} does not survive losses "
                         "(survive=True), so it cannot take ranks back")
    summed = await now.allreduce(watch.flags(now.members), timeout=timeout)
    admitted = watch.agreed(summed, now.members)
    if admitted:
        await admit(h, now, admitted, state, meta)
    return admitted


async def join_handle(h: Any, comm: Any, state: Sequence[Any] = (),
                      timeout: float | None = None) -> dict[str, Any]:
    """The generic joiner side for a bare partial handle ``h`` made on ``comm`` (whose
    ``joined`` is set) before any call: be taken back at the members' next
    :func:`admit_ready`, receive ``state`` into the given arrays, grow ``h``. Returns the
    members' meta data. Call it before the handle's first call."""
    grown, first, meta = await join(comm, h.name, state, timeout)
    members = list(grown.members)
    ranks = [members.index(m) if m in members else -1 for m in range(comm.job.size)]
    await comm.on_runtime(lambda: h.grow(grown, first, ranks))
    return meta


async def check(comm: Any, state: Sequence[Any], timeout: float | None) -> None:
    """Every rank of ``comm`` compares its :func:`digest` of ``state`` with the others'
    (collective); raises :class:`StateMismatchError` naming the ranks that differ from the
    lowest rank."""
    mine = digest(state)
    got = await comm.allgather(np.array([mine], np.int64), timeout)
    ds = [int(v) for v in got[:, 0]]
    differ = [r for r, v in enumerate(ds) if v != ds[0]]
    if differ:
        raise StateMismatchError(f"after the join, the states of ranks {differ} differ from "
                                 f"rank 0's (digests {ds})")


async def _settled(job: Any, futs: list[asyncio.Future[Any]], timeout: float | None,
                   what: str) -> None:
    await _bounded(job, lambda: asyncio.gather(*futs), timeout, what)


def _deliver(box: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
    if not box.done() and not fut.cancelled() and fut.exception() is None:
        box.set_result(fut.result())


async def _bounded(job: Any, wait: Any, timeout: float | None, what: str) -> Any:
    """Await ``wait()`` (futures of the runtime's loop) there, at most ``timeout`` seconds:
    :class:`~asynccoll.CollectiveTimeoutError` saying what this rank did not do."""

    async def run() -> Any:
        return await wait()

    try:
        return await job.run_on_runtime(run, timeout)
    except asyncio.TimeoutError:
        raise CollectiveTimeoutError(f"rank {job.rank}: did not {what} within {timeout} s"
                                     ) from None
