"""The training classes' side of taking a lost rank back (:mod:`asynccoll.comm.joining`).

A training class over a persistent partial allreduce (:class:`~.eager.EagerSGD` and its
variants) admits restarted ranks at its **sync events** (a flush of the partial allreduce and
an allreduce of the parameters, eager-SGD's model synchronisation): that is the flush boundary
the protocol needs, and right after the parameter allreduce every member holds the same
parameters. So:

* a member that learned a restarted rank is ready *plans* a sync event
  (:meth:`~asynccoll.comm.partial.PartialAllreduce.plan_flush`): every rank learns of the plan
  from the next execution that completes, and at its next step hands its gradient to the
  event's flush (``h.flush(x=g)``) instead of a call: the planned flush waits until every
  rank began it, so the step's own execution is the whole flush, where a sync event
  triggered after a step costs that step's execution and a flush of one to three more
  (measured at 64 MiB: 93-322 ms more). The event comes a step or two after the member heard;
  a rank that had not learned of the plan in time joins the event as any other (its call's
  result says a rank flushes);
* the event's allreduce also sums one flag per rank of the job: the ranks ready on every
  member are admitted, the same set everywhere;
* the members make their optimizer state equal too (the momentum of the lowest member, one
  broadcast, when there is any), grow the handle, and stripe the parameters, the optimizer
  state and the step counters to the joiners; every rank checks a digest of the state: the
  joiner before its first step returns, a member at its next sync event, before that event's
  allreduce (:func:`~asynccoll.comm.joining.admit_sent`: the digests' exchange goes on while
  the members step, so they do not wait there for the joiner to hash what it received; a
  mismatch raises :class:`~asynccoll.comm.joining.StateMismatchError` on every rank at that
  point, and :meth:`finish` settles it too);
* a joiner's first :meth:`step` does the joining side (its gradient, computed on parameters it
  had not yet received, is not contributed) and returns with ``StepInfo.joined`` set; from its
  next step on it contributes, and ``step_count`` is the members' global step, so a loop
  ``while opt.step_count < N`` runs unchanged on every rank, first start or restart.

A rank lost during the synchronous part of a sync event (the parameters' allreduce, an
admission's broadcasts, stripes or digests) does not end a job that survives losses: the event
ends there on the ranks it failed on, and another follows at their next step
(:meth:`JoinSide._lost_in_event`), whose flush recovers the partial allreduce over the
survivors and whose allreduce averages the parameters again.

The members' pause is one sync event held in the step's own execution, plus the
admission: one stripe of the state each, the handle's rebuild (which keeps its send buffer)
and the momentum's broadcast (measured: ``bench/join.py``, docs/benchmarks.md "join").

The synchronous classes (:class:`~.odsgd.ODSGD`, :class:`~.topk_sgd.TopKSGD`) take joiners
back with the same parts at a step boundary instead of a sync event (:mod:`.rounds`): their
state is what :meth:`TakesJoinersBack._state` returns through the hooks ``_replica`` and
``_replica_updater`` (OD-SGD's global weights and global updater), their counters go through
``_join_meta`` and ``_restore``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm import joining
from ..errors import PeerLostError
from .info import StepInfo

if TYPE_CHECKING:
    from ..comm.communicator import Communicator
    from ..comm.partial import PartialAllreduce

__all__ = ["JoinSide", "TakesJoinersBack"]

log = logging.getLogger("asynccoll.train")


class JoinSide:
    """What every training class shares of taking restarted ranks back (this module's
    :class:`TakesJoinersBack`, the torch optimizer's :class:`~asynccoll.torch.joining.
    SyncEvents`): watching for ready ranks, the global step. The class provides ``steps``,
    ``_h``, :meth:`_job_comm` and :meth:`_comm_now`."""

    steps: int
    _joiners: joining.Joiners | None = None
    _joining: bool = False
    _sync_wanted: bool = False  # a loss cut the last sync event short: another follows

    def _job_comm(self) -> Any:
        """The (async) communicator the class was made with."""
        raise NotImplementedError

    def _comm_now(self) -> Any:
        """The communicator of the ranks training now (the survivors', the grown one)."""
        raise NotImplementedError

    def _handle(self) -> Any:
        """The class's partial allreduce handle (None: it runs none)."""
        raise NotImplementedError

    def _join_init(self) -> None:
        """After the handle is made: members of a surviving job watch for restarted ranks; a
        restarted process joins at its first step."""
        h, c = self._handle(), self._job_comm()
        if h is None or not c.survive:
            return
        self._joiners = joining.Joiners(c.job, h.name)
        self._joining = bool(c.joined)

    @property
    def step_count(self) -> int:
        """The global step: this rank's steps, or, on a rank that joined, the members' count
        when it joined plus its own steps since. Loop on it (``while opt.step_count < N``) and
        a restarted rank goes on where the job is."""
        return self.steps

    def _join_wanted(self) -> bool:
        """Whether a restarted rank is ready here and not yet admitted (trigger a sync)."""
        return self._joiners is not None and self._joiners.waiting(self._comm_now().members)

    def _lost_in_event(self, exc: PeerLostError, where: str, comm: Any = None) -> None:
        """A rank was lost in the synchronous part of a sync event (``where``: the
        parameters' allreduce over ``comm``, an admission's broadcasts, stripes or digests).
        In a job that survives losses the survivors go on, as their partial handle does: this
        rank starts another event at its next step (the others join it: a flushed result; a
        finish loop at once), whose flush recovers the handle over the survivors and whose
        allreduce averages the parameters again. Ranks that completed the failed part
        meanwhile (a collective can end on some ranks before a loss fails it on others) hold
        averaged parameters, the others not yet: the next event evens them out. A joiner
        whose admission failed raises in its join and is restarted again; one that completed
        it goes on in the grown membership, where the loss is recovered like any other. In a
        job that does not survive losses, ``exc`` is raised: the loss ends it."""
        if self._joiners is None:
            raise exc
        # exc names the rank in the numbering of the collective that failed: the job's rank
        # where that is ``comm`` (the ranks training now), else the error as it says it
        members = list(getattr(comm, "members", ()))
        who = f"rank {members[exc.rank]}" if 0 <= exc.rank < len(members) else f"a rank ({exc})"
        log.warning("rank %d: %s lost during %s's sync event (%s): the survivors go on, "
                    "another event follows", self._job_comm().rank, who,
                    type(self).__name__, where)
        self._sync_wanted = True


class TakesJoinersBack(JoinSide):
    """The joining side of a training class over NumPy parameters (module doc). The class
    provides ``comm``, ``params``, ``updater``, ``steps``, ``syncs``, ``timeout``, ``_h`` and
    ``_comm_now()``, or overrides the hooks that use them."""

    comm: Communicator
    params: Any
    updater: Any
    syncs: int
    timeout: float | None
    _h: PartialAllreduce | None
    _check: joining.DigestCheck | None = None  # the last admission's digests, in flight

    def _job_comm(self) -> Communicator:
        return self.comm

    def _handle(self) -> PartialAllreduce | None:
        return self._h

    def _comm_now(self) -> Communicator:
        raise NotImplementedError

    def _join_slots(self) -> int:
        """How many entries the sync event's allreduce carries for joining (0 or P)."""
        return 0 if self._joiners is None else self.comm.job.size

    def _join_flags(self, out: Any) -> None:
        """Write this member's ready flags into ``out`` (the sync buffer's joining slots)."""
        if self._joiners is not None:
            out[...] = self._joiners.flags(self._comm_now().members)

    def _replica(self) -> Any:
        """The parameters that are equal on every member (what a joiner receives)."""
        return self.params

    def _replica_updater(self) -> Any:
        """The update rule applied to :meth:`_replica` (its momentum is replicated too)."""
        return self.updater

    def _has_momentum(self) -> bool:
        """Whether the updater keeps a momentum buffer (made, zero, if it has none yet: the
        state has the same arrays on every rank)."""
        up = self._replica_updater()
        if not getattr(up, "momentum", 0.0):
            return False
        if getattr(up, "_v", None) is None:
            up._v = np.zeros_like(self._replica())
        return True

    def _state(self) -> list[Any]:
        """The arrays a joiner receives and every rank's digest covers."""
        w = self._replica()
        return [w, self._replica_updater()._v] if self._has_momentum() else [w]

    def _join_meta(self) -> dict[str, Any]:
        """The small data a joiner receives with the state (the counters)."""
        return {"steps": self.steps, "syncs": self.syncs}

    def _restore(self, meta: dict[str, Any]) -> None:
        """On a joiner, once the state is in: take the members' counters (:meth:`_join_meta`)."""
        self.steps = int(meta.get("steps", 0))
        self.syncs = int(meta.get("syncs", 0))

    async def _admit_agreed(self, summed: Any, *, equal: bool) -> None:
        """After the sync event's allreduce: take back the ranks ready on every member.
        ``equal``: whether the parameters are equal on every member (averaged); if not, the
        lowest member's are given to the others first (one broadcast)."""
        if self._joiners is None:
            return
        now = self._comm_now()
        admitted = self._joiners.agreed(summed, now.members)
        if not admitted:
            return
        try:
            if not equal:
                await now.broadcast(self.params, 0, self.timeout, out=self.params)
            if self._has_momentum():  # equal too: the lowest member's (one broadcast, in
                v = self.updater._v  # place: a loss midway leaves it part the lowest's)
                await now.broadcast(v, 0, self.timeout, out=v)
            assert self._h is not None
            _, self._check = await joining.admit_sent(self._h, now, admitted, self._state(),
                                                      self._join_meta())
        except PeerLostError:
            self._joiners.again(admitted)  # (those still waiting: asked at the next event)
            raise

    async def _settle_join(self) -> None:
        """At a sync event, before its allreduce (the grown communicator's next collective):
        the last admission's digest comparison ended (module doc); raises
        :class:`~asynccoll.comm.joining.StateMismatchError` if the states differed."""
        check, self._check = self._check, None
        if check is not None:
            await check.settle()

    async def _join_step(self) -> StepInfo:
        """A restarted rank's first step: be taken back, receive the state."""
        self._joining = False
        h = self._handle()
        assert h is not None
        name = h.name
        self._has_momentum()
        # the handle grows as soon as the header says the new world (while the state comes)
        grown, first, meta = await joining.join(self.comm, name, self._state(), self.timeout,
                                                grow=joining.grow_into(h, self.comm.size))
        self._restore(meta)
        P = grown.size
        return StepInfo(first - 1, False, frozenset(), 0, 0, 0.0, joined=True,
                        fresh=frozenset(range(P)))
