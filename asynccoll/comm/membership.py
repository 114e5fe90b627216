"""Who is still in the job: lost ranks told to everyone, and the goodbyes of an orderly close.

A transport only sees its own connections: when rank L is killed, the ranks connected to it
learn it at once, and a rank that only waits for another survivor learns nothing until that
survivor gives up too, and then blames the wrong rank. So a rank that sees a peer lost tells
every other rank (a notice frame on a reserved schedule id), and a rank that learns of a loss
fails every execution under way with a :class:`~asynccoll.PeerLostError` naming the rank
lost. Over the same channel, closing is collective: :meth:`Membership.goodbye` tells every peer
this rank is closing and waits (serving them meanwhile) until each has said the same.

The same channel answers **status probes** (:meth:`Membership.probe`): a rank whose collective
stalls asks every peer what each of its executors waits for; the peer's runtime loop answers at
once, so a rank that does not answer within the probe's window is stopped, blocked or gone.

Costs nothing while nobody is lost or stalls: two receives posted per peer, and no work per
collective.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PeerLostError, ProtocolError
from ..sched import LiveOps
from ..transport.base import Transport
from ..transport.frames import Kind, Message
from ..transport.matching import ignore_outcome

__all__ = ["CLOSE_SCHED", "DEFAULT_CLOSE_TIMEOUT", "LOST_SCHED", "STATUS_REPLY", "STATUS_SCHED",
           "Membership"]

log = logging.getLogger("asynccoll.comm")

#: seconds :meth:`Communicator.close` waits by default for the other ranks to close too
DEFAULT_CLOSE_TIMEOUT = 30.0
#: the schedule id of the goodbye frames (no schedule has it: counters count from 1 and named
#: handles' ids are at or above ``4 << 60``)
CLOSE_SCHED = 3 << 60
#: the schedule id of the loss notices; execution = the sender's notice count, payload = the
#: lost rank and the incarnation of its process that was lost (which process of the rank:
#: :attr:`Transport.incarnation`), two int64
LOST_SCHED = CLOSE_SCHED + 1
#: the schedule id of status probes (execution = the asker's probe count, no payload) and of
#: their answers (the same execution; JSON of :meth:`LiveOps.statuses`, activation frames, so
#: an answer that comes after the asker gave up is dropped without complaint)
STATUS_SCHED = CLOSE_SCHED + 2
STATUS_REPLY = CLOSE_SCHED + 3
#: the channels of the survivors' agreement (:meth:`Membership.agree`): a coordinator's
#: question (execution = the coordinator's rank, no payload), the answers (the same execution;
#: int64 ``[decided, *ranks]``) and its decision (the same execution; int64 ranks lost)
AGREE_ASK = CLOSE_SCHED + 4
AGREE_ANSWER = CLOSE_SCHED + 5
AGREE_DECIDE = CLOSE_SCHED + 6
#: seconds a closing rank lets the executions under way here finish once every rank closed
IN_FLIGHT_GRACE = 2.0
_NOTHING = memoryview(b"")


def _ints(values: list[int]) -> memoryview:
    return np.asarray(values, np.int64).data.cast("B")


def _decode(payload: memoryview, at_least: int = 0) -> list[int]:
    if len(payload) % 8 or len(payload) < 8 * at_least:
        raise ProtocolError(f"an agreement frame of {len(payload)} bytes (not {at_least} or "
                            "more int64s)")
    return [int(v) for v in np.frombuffer(payload, np.int64)]

class Membership:
    """The lost ranks and the goodbyes of one rank's communicator, on the transport's loop.

    ``live``: the executors to fail when a rank is lost.
    """

    def __init__(self, transport: Transport, live: LiveOps) -> None:
        self.transport = transport
        self.live = live
        #: the first loss this rank learned of, or None
        self.lost: PeerLostError | None = None
        #: every rank this rank learned is lost, and the vacant ranks of a job that may grow
        #: (:meth:`Transport.vacate <asynccoll.transport.base.Transport.vacate>`: no process
        #: held them yet; not a loss, and never :attr:`lost`; read on the loop: :meth:`watch`)
        self.gone: set[int] = set()
        self._closing: Callable[[], bool] = lambda: False
        self._sent: dict[int, int] = {}  # per peer: the loss notices sent to it
        self._recvs: dict[int, asyncio.Future[Message]] = {}
        self._asks: dict[int, asyncio.Future[Message]] = {}
        self._probes = 0
        #: the ranks lost, as the survivors agreed (:meth:`agree`), once agreed
        self.decided: frozenset[int] | None = None
        self._changed: asyncio.Event | None = None
        self._agree_asks: list[asyncio.Future[Message]] = []
        self._agreeing: asyncio.Future[frozenset[int]] | None = None
        #: ``cb(rank)`` for each rank learned lost, after the executions were failed (on the
        #: transport's loop; a surviving partial handle starts its recovery there)
        self.listeners: list[Callable[[int], None]] = []
        #: ``cb(rank)`` each time a new process took lost ``rank``'s place (on the transport's
        #: loop, after this membership forgot the loss; :mod:`.joining`)
        self.join_listeners: list[Callable[[int], None]] = []
        #: the ranks whose place a new process took, in order (a rank may come back twice)
        self.rejoined: list[int] = []
        #: the vacant ranks a process took (a job that grew): new to it, not back
        self.grown: set[int] = set()

    @property
    def _peers(self) -> list[int]:
        t = self.transport
        return [r for r in range(t.world_size) if r != t.rank]

    # -- losses ------------------------------------------------------------------------------
    def watch(self, closing: Callable[[], bool]) -> None:
        """Start: listen for the transport's losses and the peers' notices. ``closing()`` says
        whether the communicator is closing (a peer that leaves then is no loss)."""
        self._closing = closing
        # the vacant ranks, read here on the loop (the transport changes the set there): a
        # process that took one before this listens is no longer among them
        t = self.transport
        self.gone |= t.vacant
        self.grown |= t.taken - self.gone
        self.rejoined += sorted(t.taken)  # (taken before: new processes in those places too)
        self.transport.on_peer_lost(self._on_peer_lost)
        self.transport.on_peer_joined(self._on_peer_joined)
        for r in self._peers:
            self._post_recv(r, 0)
            self._post_ask(r, 0)
        self.live.prober = self
        for r in self._peers:
            fut = self.transport.post_recv(r, AGREE_ASK, r, 0)
            fut.add_done_callback(functools.partial(self._on_agree_ask, r))
            self._agree_asks.append(fut)

    def _on_peer_joined(self, rank: int) -> None:
        """A new process took lost ``rank``'s place (the transport admitted it): forget the
        loss (and the first loss learned, when it was this one), listen to the new process
        from its first notice on, and tell the join listeners. The executions failed by the
        loss stay failed, and the survivors' agreement stands (:meth:`agree` decides once per
        communicator: ``shrink`` keeps returning the survivors' communicator); who trains with
        the new process is agreed by the handles' own admission (:mod:`.joining`), on a
        communicator of its own."""
        if self._closing():
            return
        # vacant until now (the transport moved it to ``taken``), not a restart of a taken one
        grew = rank in self.transport.taken and rank not in self.rejoined
        self.gone.discard(rank)
        if self.lost is not None and self.lost.rank == rank:
            self.lost = None if not self.gone else PeerLostError(
                min(self.gone), "lost (an earlier loss; another rank rejoined since)")
        self._sent[rank] = 0
        self._post_recv(rank, 0)
        self._post_ask(rank, 0)
        self.rejoined.append(rank)
        if grew:
            self.grown.add(rank)
            log.warning("rank %d: a new process took vacant rank %d (the job may grow)",
                        self.transport.rank, rank)
        else:
            log.warning("rank %d: a restarted process took the place of lost rank %d",
                        self.transport.rank, rank)
        for cb in list(self.join_listeners):
            try:
                cb(rank)
            except Exception:  # a listener's bug must not stop the others
                log.exception("rank %d: a join listener failed", self.transport.rank)

    def stop(self) -> None:
        """Stop listening for notices and probes (the communicator closes)."""
        if self.live.prober is self:
            self.live.prober = None
        for f in (*self._recvs.values(), *self._asks.values()):
            f.cancel()
        self._recvs.clear()
        self._asks.clear()
        for f in self._agree_asks:
            f.cancel()
        self._agree_asks.clear()

    # -- status probes -----------------------------------------------------------------------
    def _post_ask(self, src: int, seq: int) -> None:
        self._listen(STATUS_SCHED, self._asks, self._on_ask, src, seq)

    def _on_ask(self, src: int, seq: int, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self._post_ask(src, seq + 1)
        try:
            statuses = self.live.statuses()
            if self._closing():
                # A closing rank answers too (it used to fall silent, and a peer's stall
                # warning called it "not responding (stopped, blocked or gone)"): it will make
                # no further call, and waits for the others' goodbyes.
                statuses.append({"name": "close()", "state": "closing", "sid": -1,
                                 "text": "closing: it makes no further call and waits for "
                                         "the other ranks to close"})
            answer = json.dumps(statuses).encode()
        except Exception as exc:  # an answer must never break the runtime
            answer = json.dumps([{"error": repr(exc)}]).encode()
        self.transport.post_frame(src, int(Kind.ACTIVATION), STATUS_REPLY, seq, 0,
                                  memoryview(answer)).add_done_callback(ignore_outcome)

    async def probe(self, window: float) -> dict[int, list[dict[str, object]] | None]:
        """Ask every other rank what its executors wait for; wait at most ``window`` seconds
        (less once all answered). Returns, per rank, its executors' statuses
        (:func:`~asynccoll.sched.waits.wait_status`), or ``None`` for a rank that did not
        answer (stopped, its loop blocked, or lost). Runs on the transport's loop; costs one
        empty message to and one small answer from each peer."""
        t = self.transport
        seq = self._probes
        self._probes += 1
        peers = self._peers
        futs = {r: t.post_recv(r, STATUS_REPLY, seq, 0) for r in peers}
        for r in peers:
            t.post_frame(r, int(Kind.DATA), STATUS_SCHED, seq, 0,
                         _NOTHING).add_done_callback(ignore_outcome)
        out: dict[int, list[dict[str, object]] | None] = {}
        try:
            if futs:
                await asyncio.wait(list(futs.values()), timeout=window)
            for r, f in futs.items():
                out[r] = None
                if f.done() and not f.cancelled() and f.exception() is None:
                    try:
                        got = json.loads(bytes(f.result().payload))
                    except ValueError:
                        continue
                    if isinstance(got, list):
                        out[r] = [x for x in got if isinstance(x, dict)]
        finally:
            t.finish(STATUS_REPLY, seq)  # retire the unanswered; a late answer is dropped
        return out

    def _post_recv(self, src: int, seq: int) -> None:
        self._listen(LOST_SCHED, self._recvs, self._on_notice, src, seq)

    def _listen(self, sched: int, box: dict[int, asyncio.Future[Message]],
                on: Callable[[int, int, asyncio.Future[Message]], None], src: int,
                seq: int) -> None:
        """Post the receive of notice ``seq`` from ``src`` on channel ``sched``; ``on(src,
        seq, fut)`` handles it (and posts the next)."""
        fut = self.transport.post_recv(src, sched, seq, 0)
        box[src] = fut
        fut.add_done_callback(functools.partial(on, src, seq))

    def _on_notice(self, src: int, seq: int, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None or self._closing():
            return  # src itself is gone (its loss comes on its own), or we close
        payload = fut.result().payload
        self._post_recv(src, seq + 1)
        t = self.transport
        if len(payload) != 16:
            log.warning("rank %d: a malformed loss notice from rank %d; ignored", t.rank, src)
            return
        lost, incarnation = (int(v) for v in np.frombuffer(payload, np.int64))
        if not (0 <= lost < t.world_size and lost != t.rank):
            return
        if incarnation < t.incarnation_of(lost):
            # About a process that a restart already replaced here: rank ``src`` saw the old
            # one go after (or before) this rank took the new one in. Not a loss of the new.
            log.info("rank %d: rank %d reported process %d of rank %d lost; this rank talks "
                     "to its process %d: ignored", t.rank, src, incarnation, lost,
                     t.incarnation_of(lost))
            return
        self.learn(PeerLostError(lost, "left without a goodbye" if lost == src
                                 else f"reported lost by rank {src}"), tell=False)

    def _on_peer_lost(self, rank: int, exc: PeerLostError) -> None:
        # While closing, a peer that leaves has said goodbye (or is past caring); otherwise a
        # connection that ends is a lost rank, whatever the transport saw.
        if not self._closing():
            self.learn(exc, tell=True)

    def learn(self, exc: PeerLostError, *, tell: bool) -> None:
        """Rank ``exc.rank`` is lost: tell every other peer (``tell``), and, the first time,
        write the flight record (:meth:`LiveOps.record_flight`) to the trace files and fail
        every execution under way with a :class:`PeerLostError` naming it."""
        t = self.transport
        if exc.rank in self.gone and not tell:
            return
        self.gone.add(exc.rank)
        self.grown.discard(exc.rank)  # (a new process in its place comes back, not in)
        if self._changed is not None:
            self._changed.set()
        first = self.lost is None
        if first:
            self.lost = exc
            log.warning("rank %d: rank %d lost (%s); failing every collective", t.rank,
                        exc.rank, exc.reason)
        if tell:
            self._notify(exc.rank)
        if first:
            # the post-mortem: this rank's last collectives, into its trace (when it traces)
            try:
                self.live.record_flight(f"rank {exc.rank} lost ({exc.reason})")
            except Exception as err:  # a post-mortem must not stop the failing of executions
                log.warning("rank %d: no flight record: %r", t.rank, err)
            for ex in self.live.executors():
                ex.abort(PeerLostError(exc.rank, exc.reason))
        for cb in list(self.listeners):
            try:
                cb(exc.rank)
            except Exception:  # a listener's bug must not stop the others
                log.exception("rank %d: a loss listener failed", t.rank)

    def announce_leaving(self) -> None:
        """Tell every peer that this rank leaves without a goodbye (an abort), as a broken
        connection would: for a group, whose connections are its parent's and stay up."""
        self._notify(self.transport.rank)

    def _notify(self, lost: int) -> None:
        """Send every peer but ``lost`` a loss notice naming ``lost`` and which of its
        processes (numbered per peer: a process that took a lost rank's place counts them
        from 0)."""
        t = self.transport
        incarnation = t.incarnation if lost == t.rank else t.incarnation_of(lost)
        note = np.array([lost, incarnation], np.int64).data.cast("B")
        for r in self._peers:
            if r != lost:
                seq = self._sent.get(r, 0)
                self._sent[r] = seq + 1
                t.post_frame(r, int(Kind.DATA), LOST_SCHED, seq, 0,
                             note).add_done_callback(ignore_outcome)

    # -- the survivors' agreement -----------------------------------------------------------
    def _on_agree_ask(self, src: int, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        if self.decided is not None:
            answer = [1, *sorted(self.decided)]
        else:
            answer = [0, *sorted(self.gone)]
        self.transport.post_frame(src, int(Kind.DATA), AGREE_ANSWER, src, 0, _ints(answer)
                                  ).add_done_callback(ignore_outcome)

    async def agree(self) -> frozenset[int]:
        """The set of lost ranks, the same on every survivor (``MPI_Comm_agree``'s job, for
        ``shrink``). Runs on the transport's loop; every survivor calls it.

        The coordinator is the lowest rank this rank does not know lost. It asks every other
        rank it does not know lost for the ranks that rank knows lost, and decides their union
        (with the ranks lost while it asked); a rank that has decided already answers with its
        decision instead, which the coordinator then adopts, so a decision, once made, is the
        one every later coordinator hands out. Every other rank waits for its coordinator's
        decision; when the coordinator is lost first, it moves to the next. Every rank that
        decides (coordinator or not) passes the decision on to the ranks not in it, so a
        survivor that comes late finds it waiting from whichever rank it takes for its
        coordinator, even when the one that decided is lost since. A rank answers
        questions on its runtime loop whether or not its caller has reached ``shrink`` yet, so
        a slow survivor delays the decision by no more than its loop's latency, and its own
        ``agree`` finds the decision waiting. Concurrent callers share one agreement. Costs
        one question and one answer per survivor, and a decision from each. A rank lost
        during the agreement is in the decision when the coordinator learns of it before it
        decides; otherwise the next ``shrink`` finds it.
        Known limit: a network partition (ranks that each see the other lost while both live)
        is not resolved; the transports report a broken connection to both ends.
        """
        if self.decided is not None:
            return self.decided
        if self._agreeing is None:
            self._agreeing = asyncio.ensure_future(self._agree())
        return await asyncio.shield(self._agreeing)

    async def _agree(self) -> frozenset[int]:
        t = self.transport
        self._changed = asyncio.Event()
        try:
            while self.decided is None:
                alive = [r for r in range(t.world_size) if r not in self.gone]
                c = alive[0]
                if c == t.rank:
                    self.decided = await self._coordinate([r for r in alive if r != c])
                else:
                    fut = t.post_recv(c, AGREE_DECIDE, c, 0)
                    got = await self._wait_or_change([fut], c)
                    if got:
                        self.decided = frozenset(_decode(fut.result().payload))
                    else:
                        fut.cancel()
                        if c not in self.gone:
                            self.learn(PeerLostError(c, "lost during the agreement"),
                                       tell=True)
        finally:
            self._changed = None
        for r in range(t.world_size):  # pass it on: see the docstring
            if r != t.rank and r not in self.decided:
                t.post_frame(r, int(Kind.DATA), AGREE_DECIDE, t.rank, 0,
                             _ints(sorted(self.decided))).add_done_callback(ignore_outcome)
        return self.decided

    async def _coordinate(self, peers: list[int]) -> frozenset[int]:
        t = self.transport
        futs = {r: t.post_recv(r, AGREE_ANSWER, t.rank, 0) for r in peers}
        for r in peers:
            t.post_frame(r, int(Kind.DATA), AGREE_ASK, t.rank, 0, _NOTHING
                         ).add_done_callback(ignore_outcome)
        lost = set(self.gone)
        for r, fut in futs.items():
            if r in self.gone or not await self._wait_or_change([fut], r):
                fut.cancel()
                lost.add(r)
                continue
            flag, *ranks = _decode(fut.result().payload, at_least=1)
            if flag:
                for f in futs.values():
                    f.cancel()
                return frozenset(ranks)  # decided already: that decision stands
            lost.update(ranks)
        return frozenset(lost | self.gone)

    async def _wait_or_change(self, futs: list[asyncio.Future[Message]], peer: int) -> bool:
        """Wait for ``futs``; False once ``peer`` is known lost (or a future fails)."""
        assert self._changed is not None
        while True:
            if peer in self.gone:
                return False
            self._changed.clear()
            changed: asyncio.Future[Any] = asyncio.ensure_future(self._changed.wait())
            waiting: list[asyncio.Future[Any]] = [*futs, changed]
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if any(f in done for f in futs):
                return all(f.done() and not f.cancelled() and f.exception() is None
                           for f in futs)

    # -- goodbyes ----------------------------------------------------------------------------
    async def goodbye(self, wait: float) -> None:
        """Tell every peer this rank is closing, serve them until each has said the same (or
        is lost), then let the executions under way here complete; at most ``wait`` seconds
        in all. Warns naming the ranks that did not close in time."""
        t = self.transport
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # Not the ranks known lost: they say nothing more. (A lost rank whose place a new
        # process took since is still lost to a group made before, whose transport view it
        # never joined: only the job's membership forgets a loss, and only its groups made
        # after it include the new process.)
        peers = [r for r in self._peers if r not in self.gone]
        for r in peers:
            t.post_frame(r, int(Kind.DATA), CLOSE_SCHED, 0, 0,
                         _NOTHING).add_done_callback(ignore_outcome)
        byes = [t.post_recv(r, CLOSE_SCHED, 0, 0) for r in peers]
        _, pending = await asyncio.wait(byes, timeout=wait) if byes else (set(), set())
        for f in byes:
            if f.done() and not f.cancelled():
                f.exception()  # a peer lost while we waited has said goodbye in its way
        if pending:
            missing = sorted(peers[i] for i, f in enumerate(byes) if f in pending)
            for f in pending:
                f.cancel()
            log.warning("rank %d: ranks %s did not close within %.3g s; closing anyway",
                        t.rank, missing, wait)
            return
        busy = [ex.current for ex in self.live.executors() if ex.in_flight]
        if busy:
            # An execution that can complete does so within the network's time once every
            # rank serves; one that waits for a call nobody will make (a quorum that timed
            # out, say) never does: give them a short grace, not the whole close timeout.
            grace = min(max(deadline - loop.time(), 0.0), IN_FLIGHT_GRACE)
            _, late = await asyncio.wait(busy, timeout=grace)
            if late:
                log.warning("rank %d: %d executions still under way at close; cancelled",
                            t.rank, len(late))
