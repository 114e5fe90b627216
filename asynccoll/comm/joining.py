"""Taking a lost rank back: admission at a flush boundary, state striped over the members
(DESIGN §6, §10; docs/groups.md, "Joining").

A process restarted in a lost rank's place (``asynccoll run --max-restarts``) connects to every
member (:meth:`Transport.rejoin <asynccoll.transport.base.Transport.rejoin>`; its
communicator has ``joined`` set). A persistent partial allreduce, dense or sparse (one handle
class: its contribution carries the send buffer over, :mod:`.contribution`), then takes it
back in four steps, at a point where every member has completed the same executions and holds no
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
4. **State.** The members stream the state to each joiner in stripes, member ``i`` of ``D`` the
   ``i``-th ``1/D`` of every array's bytes, so no member sends it all; the lowest member sends a
   small header first (the new membership, the first execution, the caller's meta data such as
   the global step, the arrays' sizes). The joiner then posts a receive for every unit of every
   stripe (:func:`.state_digest.units`: at most 8 MiB, straight into its own arrays) and only
   then tells every member ``GO`` (its host, a random token, what it can take); a
   member sends nothing before it: a stripe that arrived before its receive was posted would be
   held and copied by the matcher (it was: 1.9 GiB resident at the joiner for 1 GiB of state). A
   member on the joiner's host lets the joiner read its stripe straight out of its arrays (one
   copy, cross-memory attach) or, where the kernel refuses that, hands a large stripe over
   through a ring of slots in a shared-memory segment; the route decides
   (:func:`.route.state_route`, with the switches the communicator read once; the paths,
   their fallbacks and cleanup: :mod:`.state_send`, :mod:`.state_ring`); the others send one
   frame per unit
   over the connection. Each member's first frame (``PLAN``) says which. A stripe of at most 1
   MiB (:data:`.state_digest.INLINE_BYTES`) that cannot take a ring goes at once, before the
   ``GO`` (held and copied once at the joiner: nothing at that size), saving the members the
   round trip. The lowest member's header goes out before the members grow their handle, so the
   joiner's round trip runs meanwhile. Then every rank of the new world sends every other a
   63-bit digest of its state (:func:`.state_digest.digest`, :func:`compare`): replicas are
   equal to the bit, checked, or every rank raises :class:`StateMismatchError` naming the ranks
   that differ. The digest costs no pass of its own where there are cores to spare: a member
   hashes its state on other threads while it sends, the joiner each unit as it lands (while it
   is in the caches). A member may leave the comparison in flight
   (:func:`admit_sent`, a :class:`DigestCheck`): its digest is taken and its stripes are sent,
   so it may change its state at once, and it settles the comparison at an agreed later point
   before any other collective of the grown communicator (the training classes: their next sync
   event), where a mismatch raises on every rank alike; the joiner compares before :func:`join`
   returns.

The members' pause is the flush boundary they were at anyway, plus the time to send one stripe
(after one round trip for ``GO``, for a large stripe) and, with :func:`admit`, the digests'
exchange, which waits for the joiner to hash what it received; with :func:`admit_sent` not
that (measured: ``bench/join.py``, docs/benchmarks.md "join"). The joiner's first
contribution goes into the first execution of the new world. What the lost process held (its
send buffer, a snapshot nobody completed) was lost with it and reported lost at the time
(:mod:`.survival`); the joiner starts from nothing.

Host (NumPy) arrays only: device arrays are staged by the caller. A rank lost during the
admission fails it on every rank with :class:`~asynccoll.PeerLostError`, as a loss during any
collective does; the joiner can be restarted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgpack
import numpy as np

from ..errors import CollectiveTimeoutError, PeerLostError
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome
from .membership import CLOSE_SCHED
from .partial_member import stable_id
from .route import SHM, exchange, state_route
from .shm import new_token
from .state_digest import INLINE_BYTES, Digest, StateMismatchError, digest, units
from .state_ring import Ring
from .state_send import GO, HEADER, READY, _all, give, take_all

__all__ = ["DigestCheck", "Joinable", "Joiners", "StateMismatchError", "admit", "admit_ready",
           "admit_sent", "join", "join_handle"]

log = logging.getLogger("asynccoll.comm")

_NOTHING = memoryview(b"")


class Joinable(Protocol):
    """What :func:`admit`, :func:`admit_sent` and a joiner's caller use of the thing that
    takes a rank back: a persistent partial allreduce, dense or sparse
    (:class:`~.partial.PartialAllreduce`), the hierarchical handle, or a training class whose
    rounds are synchronous collectives (:mod:`asynccoll.train.rounds`, through a small object
    of its own). The admission's key and the joining channel derive from ``name`` and
    ``completed``; ``grow`` moves the thing onto the grown communicator."""

    @property
    def name(self) -> str:
        """Equal on every rank: the joining channel's name (:func:`channel`)."""
        ...

    @property
    def timeout(self) -> float | None:
        """The bound of the admission's waits (seconds; None: none)."""
        ...

    @property
    def completed(self) -> int:
        """The executions (rounds) completed here: the grown world's numbering goes on from
        the next one."""
        ...

    def grow(self, comm: Any, first: int, ranks: list[int]) -> None:
        """Go on over ``comm`` (the grown communicator) from execution ``first``; ``ranks``:
        each old member's rank in ``comm`` (on a joiner, -1 for the job ranks not in it)."""
        ...


def channel(name: str) -> int:
    """The schedule id of the joining messages of handle ``name`` (on the job's transport)."""
    return stable_id(f"{name}#join", 1)


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
        fut = self.job.transport.post_recv(rank, self.sid, 0, READY)
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

    def again(self, ranks: Sequence[int]) -> None:
        """An admission of ``ranks`` (:meth:`agreed`) failed on this member before it took them
        back (a loss in the event): they are ready still, until they are lost or a new process
        takes their place, and a later event asks again (a joiner says it is ready once)."""
        self.job.in_runtime(lambda: self._ready.update(
            r for r in ranks if r not in self.job.membership.gone))


async def admit(h: Joinable, now: Any, joiners: list[int], state: Sequence[Any],
                meta: dict[str, Any] | None = None) -> Any:
    """Steps 3 and 4 (module doc) on a member: every member of ``now`` (the communicator the
    handle ``h`` runs on) calls it at the same flush boundary with the same ``joiners``.
    ``state``: the arrays every joiner receives (equal on every member: the caller made them
    so); ``meta``: small msgpack-able data for the joiners (the lowest member's is sent).
    Returns the grown communicator, which the handle runs on from now on. Raises
    :class:`StateMismatchError` when the digests differ afterwards. :func:`admit_sent` and
    :meth:`DigestCheck.settle`, in one."""
    grown, pending = await admit_sent(h, now, joiners, state, meta)
    await pending.settle()
    return grown


async def admit_sent(h: Joinable, now: Any, joiners: list[int], state: Sequence[Any],
                     meta: dict[str, Any] | None = None) -> tuple[Any, DigestCheck]:
    """:func:`admit` up to the digests' comparison, which it starts (:func:`compare`, in
    flight; also where joiners were lost here: another member may have taken them in) and
    returns the grown communicator: the caller may change ``state`` at once (its digest and
    stripes are taken) and must await :meth:`DigestCheck.settle` before any other collective
    of the grown communicator (the training classes: at their next sync event), on every
    member at the same point, so that a mismatch raises :class:`StateMismatchError` on every
    rank there. The members' pause is the stripes sent, not the joiner's digest."""
    job = now.job
    old = list(now.members)
    members = sorted(set(old) | set(joiners))
    first = h.completed + 1
    key = f"join:{h.name}:{first}"
    t = job.transport
    switches = job.switches
    sid = channel(h.name)
    views = [_bytes(a) for a in state]
    d, i = len(old), old.index(job.rank)
    mine_units = units([int(v.size) for v in views], i, d)
    nbytes = sum(hi - lo for _, lo, hi in mine_units)
    # A small stripe that cannot take a ring goes at once, before the joiner's GO: what
    # arrives before its receives is held and copied once, which costs nothing at this size
    # and saves the members a round trip (module doc)
    at_once = nbytes <= INLINE_BYTES and state_route(switches, 0, 0, nbytes, True) != SHM

    grown = job.rejoined_group(members, key)
    ranks = [members.index(m) for m in old]

    def start() -> list[asyncio.Future[Any]]:  # on the runtime's loop
        gos = [t.post_recv(r, sid, 0, GO) for r in joiners]  # before the header: no wait
        if i == 0:
            head = msgpack.packb({"members": members, "key": key, "first": first,
                                  "donors": old, "meta": meta or {},
                                  "sizes": [int(v.size) for v in views]})
            for r in joiners:
                t.post_frame(r, int(Kind.DATA), sid, 0, HEADER, head
                             ).add_done_callback(ignore_outcome)
        if at_once:
            for g in gos:  # the GO still comes: taken whenever (a loss fails the receive)
                g.add_done_callback(ignore_outcome)
        # the header first: the joiner's round trip to its GO runs while the handle grows
        h.grow(grown, first, ranks)
        return gos

    gos = await job.on_runtime(start)  # (one hand-over to the runtime's thread, not two)
    # this member's digest, on an executor thread while the stripes go out (module doc);
    # a small state's here: a thread's hand-off would cost more than the hash
    if sum(int(v.size) for v in views) <= INLINE_BYTES:
        mine: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        mine.set_result(digest(state, d))
    else:
        mine = asyncio.get_running_loop().run_in_executor(None, digest, state, d)

    async def give_to(r: int, go_fut: asyncio.Future[Any]) -> None:  # on the runtime's loop
        go = None if at_once else msgpack.unpackb(bytes((await go_fut).payload))
        await give(t, sid, r, first, views, mine_units, go, switches)

    gone: list[int] = []
    try:
        await _bounded(job, lambda: _all([give_to(r, g) for r, g in zip(joiners, gos,
                                                                      strict=True)]),
                       h.timeout, "send the state to the joining ranks")
    except PeerLostError as exc:
        gone = _lost_joiners(job, joiners, h.name, exc)
        if not gone:
            raise
    finally:
        if not at_once:
            for g in gos:
                g.cancel()  # (a GO never received: its receive is no destination any more)
    value = await mine
    if not gone:
        how = "in (new to the job)" if all(r in job.membership.grown for r in joiners) \
            else "back"
        log.warning("rank %d: partial allreduce %r took rank(s) %s %s: %d ranks from "
                    "execution %d", job.rank, h.name, joiners, how, len(members), first)
    # Compared even when joiners were lost here: another member that completed their
    # admission (a joiner killed between its GOs) waits for this digest, as other joiners do
    # (seen: all waited forever); a lost joiner's restart would never answer: left out
    pending = DigestCheck(grown, asyncio.ensure_future(
        compare(grown, value, h.timeout, key, joiners, gone)), job, joiners, h.name)
    await asyncio.sleep(0)  # the comparison is under way (its first step sent this digest)
    return grown, pending


def _lost_joiners(job: Any, joiners: list[int], name: str, exc: PeerLostError) -> list[int]:
    """After ``exc`` in an admission: the joiners lost meanwhile (the grown handle goes on
    without them: its survival recovers at the next call, as after any loss; the others are
    taken back), said in one warning; none: the error is the caller's. A joiner counts as
    lost when this rank still knows it lost or when ``exc`` names it: by the time the
    comparison settles, a joiner killed during its admission may have been restarted and
    reconnected already (then it is no longer lost here, and raising would end the job for
    a loss it survived; seen under load in test_rejoin's kill-while-joining case)."""
    gone = sorted(r for r in joiners if r in job.membership.gone or r == exc.rank)
    if gone:
        log.warning("rank %d: rank(s) %s lost while joining partial allreduce %r; it goes "
                    "on without them", job.rank, gone, name)
    return gone


async def compare(grown: Any, mine: int, timeout: float | None, key: str,
                  joiners: Sequence[int] = (), gone: Sequence[int] = ()) -> None:
    """Every rank of ``grown`` compares ``mine``, its state's digest, with the others', each
    sent straight to every rank (a joiner that leaves once it found a difference keeps no
    member from finding it too); a lost joiner's (``joiners``: job ranks) is left out, a lost
    member raises; ``gone``: joiners known lost, not asked. :class:`StateMismatchError`
    names the ranks differing from the lowest's."""
    job, me, members = grown.job, grown.rank, list(grown.members)
    word = np.array([mine], np.int64).view(np.uint8)
    skip = [members.index(r) for r in gone]
    futs = await job.on_runtime(lambda: exchange(grown.transport,
                                                 stable_id(f"{key}#digest", 1), 0, word, skip))
    got = await _bounded(job, lambda: asyncio.gather(*futs.values(), return_exceptions=True),
                         timeout, "compare the state's digests after a join")
    ds: dict[int, int] = {me: mine}
    for r, m in zip(futs, got, strict=True):
        if isinstance(m, PeerLostError) and members[r] in joiners:
            continue  # (a joiner lost meanwhile: the handle goes on without it)
        if isinstance(m, BaseException):
            raise m
        ds[r] = int(np.frombuffer(bytes(m.payload), np.int64)[0])
    order = sorted(ds)
    differ = [r for r in order if ds[r] != ds[order[0]]]
    if differ:
        raise StateMismatchError(f"after the join, the states of ranks {differ} differ from "
                                 f"rank {order[0]}'s (digests {[ds[r] for r in order]})")


class DigestCheck:
    """An admission's comparison of the digests (:func:`admit_sent`, :func:`compare`), in
    flight."""

    def __init__(self, grown: Any, task: asyncio.Future[None] | None, job: Any,
                 joiners: list[int], name: str) -> None:
        self.grown, self._task = grown, task
        self._job, self._joiners, self._name = job, joiners, name

    def done(self) -> bool:
        """Whether the comparison has ended (settle then returns or raises at once)."""
        return self._task is None or self._task.done()

    async def settle(self) -> None:
        """Wait for the comparison to end: :class:`StateMismatchError` when the states
        differ (on every rank alike), what the exchange raised else, except a loss of
        joiners only (the handle goes on without them, as :func:`admit` does). Again: no-op."""
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await task
        except PeerLostError as exc:
            if not _lost_joiners(self._job, self._joiners, self._name, exc):
                raise


async def join(comm: Any, name: str, state: Sequence[Any], timeout: float | None, *,
               grow: Callable[[Any, int], None] | None = None
               ) -> tuple[Any, int, dict[str, Any]]:
    """Steps 1 and 4 (module doc) on the joiner, for the handle ``name``: say ready, receive
    the header, post a receive for every member's stripe of ``state`` (into ``state``'s own
    arrays), then say ``GO`` to every member and take what each sends (over the connection or
    through its ring in shared memory). Returns ``(communicator of the new world, its first
    execution, the meta data)``; the caller makes its handle on that communicator and grows it
    to that execution, or passes ``grow(grown, first)``, called on the runtime's loop once the
    header says them: the handle grows while the state arrives (empty until its first call)."""
    job = comm.job
    t = job.transport
    sid = channel(name)
    views = [_bytes(a) for a in state]

    box: list[_Awaited] = []

    def say(r: int) -> None:  # on the runtime's loop: "ready" to r, and its header awaited
        t.post_frame(r, int(Kind.DATA), sid, 0, READY, _NOTHING
                     ).add_done_callback(ignore_outcome)
        # its header, or its goodbye (a rank that closes first will never send one)
        box[0].wait_for(r, t.post_recv(r, sid, 0, HEADER), t.post_recv(r, CLOSE_SCHED, 0, 0))

    def ready() -> int:
        box.append(_Awaited(asyncio.get_running_loop().create_future()))
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
        box[0].cancel()

    if not await job.on_runtime(ready):
        await job.on_runtime(done)
        raise PeerLostError(job.rank, f"no member of the job is reachable to join {name!r}")
    try:
        got = await _bounded(job, lambda: box[0].header, timeout,
                             f"be taken back by the members for {name!r}")
    except _EndedFirst as exc:  # its launcher hears why first, and counts no failure
        report = job.report_joined(f"{exc.reason} (partial allreduce {name!r})", ended=True)
        if report is not None:
            with contextlib.suppress(Exception):
                await _bounded(job, lambda: report, 5.0, "tell the launcher")
        raise
    finally:
        await job.on_runtime(done)
    head = msgpack.unpackb(bytes(got.payload))
    members, donors, first = list(head["members"]), list(head["donors"]), int(head["first"])
    if [int(v.size) for v in views] != list(head["sizes"]):
        raise ValueError(f"the state given to join {name!r} has byte sizes "
                         f"{[int(v.size) for v in views]}; the members' has {head['sizes']}")
    d = len(donors)
    token = new_token()
    sums = Digest(views, d)
    grown = job.rejoined_group(members, str(head["key"]))
    if grow is not None:
        await job.on_runtime(lambda: grow(grown, first))
    try:
        by = await _bounded(job, lambda: take_all(t, sid, donors, first, views, token, sums,
                                                  job.switches),
                            timeout, f"receive the state of {name!r}")
    finally:
        for src in donors:  # a donor's ring this rank has not mapped (module doc)
            with contextlib.suppress(OSError):
                os.unlink(Ring.path(token, sid, src, first))
    others = [r for r in members if r not in donors and r != job.rank]  # joining with it
    try:
        await compare(grown, sums.value(), timeout, str(head["key"]), others)
    except PeerLostError as exc:
        # another rank taken in with this one, lost meanwhile: this one goes on without it,
        # as the members do (DigestCheck.settle); any other loss is this join's failure
        if not others or not _lost_joiners(job, others, name, exc):
            raise
    nbytes = sum(int(v.size) for v in views)
    log.warning("rank %d: joined partial allreduce %r: %d ranks from execution %d (state of "
                "%d bytes: from ranks %s through shared memory, from %s over the network; "
                "read in place from %s)", job.rank, name, len(members), first, nbytes,
                sorted(by["ring"] + by["read"]), by["network"], by["read"])
    how = "in" if t.incarnation == 0 else "back"  # a vacant rank's first process: new
    job.report_joined(f"taken {how} by ranks {donors} into {name!r} from execution {first} "
                      f"({nbytes} bytes of state)")  # (its launcher says so, the first time)
    return grown, first, dict(head["meta"])


async def admit_ready(h: Any, watch: Joiners, state: Sequence[Any] = (),
                      meta: dict[str, Any] | None = None,
                      timeout: float | None = None) -> list[int]:
    """The generic member side, for a bare partial handle ``h`` (``survive``) and user state:
    every member calls it at the same point, right after ``await h.flush()`` (the flush
    boundary); one allreduce of the ready flags over the members (``watch``: a
    :class:`Joiners` made for ``h`` when the handle was), then :func:`admit` of the ranks
    ready on every member with ``state`` (arrays equal on every member) and ``meta``. Returns
    the ranks admitted (often none). A rank that joined calls it too from then on, at the
    same points.

    ``h``: a flat partial handle, dense or sparse (:class:`~.partial.PartialAllreduce`), or a
    hierarchical one (:class:`~.hier_partial.HierPartialAllreduce`, which regrows at its next
    call); each has ``communicator``, ``completed``, ``timeout`` and ``grow``. A loss the
    members learn at this point (the flags' allreduce fails with
    :class:`~asynccoll.PeerLostError`: a host that lost nobody can finish a flush of the
    hierarchical handle before it learns of a loss) admits nobody now: the handle recovers at
    its next call, and the ranks still ready are asked again at the next sync event. (Should
    the lost rank have sent its part of the allreduce already, the members that completed it
    would go on to admit alone and time out waiting for the others: not seen, not handled.)"""
    now = h.communicator
    if now is None:
        raise ValueError(f"partial allreduce {h.name!r} does not survive losses "
                         "(survive=True), so it cannot take ranks back")
    try:
        summed = await now.allreduce(watch.flags(now.members), timeout=timeout)
    except PeerLostError:
        return []
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
    _, _, meta = await join(comm, h.name, state, timeout, grow=grow_into(h, comm.job.size))
    return meta


def grow_into(h: Any, size: int) -> Callable[[Any, int], None]:
    """:func:`join`'s ``grow`` for handle ``h`` of a job of ``size`` ranks."""
    def grow(grown: Any, first: int) -> None:
        members = list(grown.members)
        h.grow(grown, first, [members.index(m) if m in members else -1 for m in range(size)])
    return grow


async def _settled(job: Any, futs: list[asyncio.Future[Any]], timeout: float | None,
                   what: str) -> None:
    await _bounded(job, lambda: asyncio.gather(*futs), timeout, what)


class _EndedFirst(PeerLostError):
    """A joiner's members ended the job before they took it back (:func:`join`)."""


class _Awaited:
    """A joiner's wait for its header (on the runtime's loop): the first header any rank
    sends is the one (``header``). A rank that is lost, or says goodbye (it closes: it will
    never send one), is silent; once every rank awaited is, the job has ended without taking
    this rank back, and the wait fails at once with :class:`_EndedFirst`, not at its timeout.
    One silent rank is not enough: another restarted rank that gives up and closes, or a
    rank lost meanwhile, says nothing about the members."""

    def __init__(self, header: asyncio.Future[Any]) -> None:
        self.header = header
        self._futs: dict[int, tuple[asyncio.Future[Any], asyncio.Future[Any]]] = {}
        self._silent: dict[int, str] = {}  # rank -> "closed" or "lost"

    def wait_for(self, r: int, head: asyncio.Future[Any], bye: asyncio.Future[Any]) -> None:
        """Await rank ``r``'s header ``head`` or goodbye ``bye`` (again: a new process)."""
        for f in self._futs.get(r, ()):
            f.cancel()
        self._futs[r] = (head, bye)
        self._silent.pop(r, None)
        head.add_done_callback(lambda f: self._heard(r, f, "lost"))
        bye.add_done_callback(lambda f: self._heard(r, f, "closed"))

    def _heard(self, r: int, fut: asyncio.Future[Any], silent: str) -> None:
        if self.header.done() or fut.cancelled() or self._futs.get(r, ()).count(fut) == 0:
            return
        exc = fut.exception()
        if silent == "lost" and exc is None:
            self.header.set_result(fut.result())
            return
        if silent == "closed" and exc is not None:
            return  # (the goodbye's receive failed: the rank is lost, its header says so too)
        self._silent[r] = silent
        if len(self._silent) == len(self._futs):
            closed = sorted(q for q, how in self._silent.items() if how == "closed")
            lost = sorted(q for q, how in self._silent.items() if how == "lost")
            why = " and ".join(f"ranks {ranks} {what}" for what, ranks in
                               (("closed", closed), ("were lost", lost)) if ranks)
            self.header.set_exception(_EndedFirst(
                (closed or lost)[0], f"{why} before taking it back: the job ended"))

    def cancel(self) -> None:
        for pair in self._futs.values():
            for f in pair:
                f.cancel()


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
