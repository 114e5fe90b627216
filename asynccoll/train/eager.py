"""Eager-SGD: data-parallel SGD over a partial allreduce (eager-SGD §5, *Taming Unbalanced
Training Workloads in Deep Learning with Partial Collective Operations*).

Each step sums the gradients with a persistent partial allreduce of a straggler policy
(``Solo()``, ``Majority()``, ``TwoChoice()``, ``Quorum(k)``, ``Backup(b)`` or ``Deadline()``:
:mod:`asynccoll.collectives.policy`) instead of waiting for every rank; ``policy=Sync()`` is
plain synchronous SGD over :meth:`Communicator.allreduce` for comparison. A rank whose gradient
arrives after the round it was meant for leaves it in the collective's send buffer, and the next
round carries it (§5: "the stale gradient is then stored in the send buffer"): gradients are
never dropped and never counted twice.

**Averaging.** ``average="world"`` divides the summed gradient by P (the paper);
``"contributions"`` by the number of local gradients summed (``PartialResult.count``). With
``accumulate=True`` a rank that receives several rounds at once averages *each round by its own
count* and sums those averages (the handle's ``Accumulate.MEAN``), exactly what the ranks that
received the rounds one by one applied; dividing the summed rounds by the summed counts would
make its step smaller and the replicas drift apart.

**Replicas.** With ``accumulate=False`` (the paper) a rank that missed rounds applies only the
latest result, so replicas drift apart; ``sync_every`` re-synchronises them. With
``accumulate=True`` a rank applies the sum of every round it has not yet applied, so under plain
SGD (no momentum, no weight decay) every rank applies exactly the same total update and, after
:meth:`EagerSGD.finish`, all replicas are equal.

**Lost ranks** (``survive=True``). Averaging by the world divides each round by the number of
ranks *its execution* spanned: a survivor may receive the result of the last execution before a
loss only after the recovery (the recovery settles it, or it was kept and not yet handed out),
when the world is already smaller; dividing it by the new size would make its step larger than
on the survivors that received it before the loss. With ``accumulate=True`` the handle divides
each round as it completes (its ``Accumulate.WORLD``), so rounds of both worlds summed into
one result are each averaged by their own size.

**Model synchronisation (collective-safe).** A *sync event* is ``flush`` of the partial
allreduce (collective: every rank hands in all it holds and applies every result it has not
applied) followed by a synchronous average of the parameters. Any rank may *trigger* one: after
``sync_every`` of its own steps since the last event, or when more than ``max_staleness``
consecutive steps of its gradients were not in the results they returned (the staleness bound:
the rank is too far behind, so it forces a synchronous step). A triggering rank simply calls
``flush``; while any rank flushes, every result carries ``flushed=True`` (the flag rides in
the collective's meta data, which every rank reduces identically), and a rank that receives
such a result joins the event at once. So every rank enters the same sequence of events, each
one flush then one allreduce, whatever its step count: nobody waits on a collective that
another rank skips.
Spurious extra events (a flag seen just after an event) cost time, never consistency.
A rank *plans* the events it can see coming: ``sync_every`` two steps ahead, and taking in a
lost or new rank that said it is ready (:mod:`.joining`). Every rank learns of a plan from the
next execution that completes and holds the event at its next step, in that step's own
execution (``flush(x=g)``, which waits until every rank began it), which saves everyone one to
three executions of the whole state; the immediate trigger stays for a rank that did not learn
of the plan in time (and for the staleness bound, which no rank can see coming).
:meth:`EagerSGD.finish` repeats events until every rank has called it; it must be called once by
every rank after its last step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..buffers import empty_like
from ..collectives.policy import (
    POLICY_MOVED,
    Accumulate,
    Policy,
    Solo,
    as_policy,
    moved_arguments,
)
from ..comm.communicator import Communicator
from ..errors import PeerLostError
from ..results import PartialResult
from .bucket import ParamBucket
from .info import StepInfo
from .joining import TakesJoinersBack
from .updaters import SGD

__all__ = ["MOVED", "EagerSGD"]

#: the keywords the training classes took before policies were values, and what to write now
MOVED = {"mode": "give policy=Solo(), Majority(), TwoChoice(), Quorum(k), Backup(b), "
                 "Deadline() or Sync() (asynccoll), or its text ('solo', 'quorum:3')",
         **POLICY_MOVED}


class EagerSGD(TakesJoinersBack):
    """SGD whose gradient sum is a partial allreduce; see the module doc.

    ``params``: one flat array, a list of arrays or PyTorch CPU tensors (fused into one bucket;
    the originals become views of it). ``lr``, ``momentum``, ``weight_decay``: the local
    update rule (:class:`~asynccoll.train.updaters.SGD`) applied to the averaged gradient.
    ``policy``: the straggler policy (:mod:`asynccoll.collectives.policy`) or its text:
    ``Solo()`` (the default), ``Majority(seed=)``, ``TwoChoice(seed=)``, ``Quorum(k)``,
    ``Backup(b)``, ``Deadline(quorum=, bounds=, mad_factor=, window=)`` (a step's round starts
    once ``quorum`` ranks have arrived or the adaptive deadline after the first arrival
    expired; :class:`~asynccoll.train.StepInfo` reports ``deadline`` and
    ``deadline_expired``), or ``Sync()`` (a plain allreduce). ``accumulate``, ``average``,
    ``sync_every``, ``max_staleness``: module doc. ``name``: the collective's name (distinct
    per optimizer, equal on all ranks). ``timeout``: per collective call.

    Raises ``ValueError`` naming a bad argument (a policy that does not fit the world:
    ``policy``); ``TypeError`` naming the new spelling for the keywords of 0.1 (:data:`MOVED`:
    ``mode``, ``quorum``, ``seed``, ``deadline``, ``mad_factor``, ``deadline_window``). Costs
    per step: one partial allreduce of the parameter size and one vectorised update.
    """

    @moved_arguments(**MOVED)
    def __init__(self, comm: Communicator, params: Any, lr: float,
                 policy: Policy | str = Solo(), *, momentum: float = 0.0,
                 weight_decay: float = 0.0, accumulate: bool = False, average: str = "world",
                 sync_every: int | None = None, max_staleness: int | None = None,
                 name: str = "eager-sgd", timeout: float | None = None) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a Communicator, got {type(comm).__name__}")
        policy = as_policy(policy)
        if policy.partial:
            policy.activation(comm.size)  # ValueError naming the policy when it does not fit
        if average not in ("world", "contributions", "quorum"):
            raise ValueError(f"average must be 'world' or 'contributions', got {average!r}")
        for arg, v in (("sync_every", sync_every), ("max_staleness", max_staleness)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{arg} must be an int >= 1 or None, got {v!r}")
        self.comm = comm
        self.bucket = ParamBucket(params)
        self.params: Any = self.bucket.flat
        if self.params.dtype.kind != "f":
            raise ValueError(f"params must be floating point, got {self.params.dtype}")
        self.lr = float(lr)
        self.updater = SGD(self.lr, momentum, weight_decay)
        #: the straggler policy (:mod:`asynccoll.collectives.policy`)
        self.policy = policy
        self.average = average
        self.accumulate = bool(accumulate)
        self.sync_every = sync_every
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.steps = 0  #: steps taken by this rank
        self.syncs = 0  #: sync events this rank took part in
        #: local gradients (of all ranks) summed into the updates this rank applied
        self.applied = 0
        self._since_sync = 0
        self._stale_run = 0
        self._averaged = False  # whether the latest sync event averaged the parameters
        self._h = None
        if policy.partial:
            self._h = comm.partial_allreduce(
                policy, like=self.params, name=name,
                # accumulated rounds each divided by its own count (MEAN), or by the size of
                # the world it spanned when it completes (WORLD: module doc, "Lost ranks")
                accumulate=Accumulate.MEAN if self._mean_rounds() else
                Accumulate.WORLD if self._world_rounds() else
                Accumulate.SUM if self.accumulate else Accumulate.LATEST)
            self._h.flush_hint = f"'await opt.finish()' of the {type(self).__name__}"
            self._join_init()  # restarted ranks taken back at sync events (.joining)
        n = self.params.size
        self._sync_buf = np.empty(n + 2 + self._join_slots(), self.params.dtype)
        # Each step's result lands here (the call's out=): no fresh array per step, whose page
        # faults cost more than the collective at 16 MiB (docs/benchmarks.md)
        self._rbuf = None if self._h is None else empty_like(self.params)
        # Where a list of gradients is fused (the collective copies it, so it can be reused).
        self._gbuf = np.empty(n, self.params.dtype) if isinstance(self.params, np.ndarray) \
            and not isinstance(params, np.ndarray) else None

    @property
    def world_size(self) -> int:
        """The ranks training now: the communicator's size, or the survivors' number once
        the partial collective went on without lost ranks (``survive=True``, docs/groups.md);
        averages divide by it."""
        return self.comm.size if self._h is None else self._h.world_size

    def _comm_now(self) -> Communicator:
        """The communicator of the ranks training now (the survivors' after a loss)."""
        sv = None if self._h is None else self._h._survival
        return self.comm if sv is None else sv.comm

    # -- hooks for the variants --------------------------------------------------------------
    def _combine(self) -> Any:
        """The partial allreduce's ``combine`` hook for this step (None: add to the buffer)."""
        return None

    def _mean_rounds(self) -> bool:
        """Whether accumulated rounds are averaged each by its own count (module doc)."""
        return self.accumulate and self.average == "contributions"

    def _world_rounds(self) -> bool:
        """Whether accumulated rounds are averaged each by its own world size (module doc,
        "Lost ranks")."""
        return self.accumulate and self.average == "world"

    def _divisor(self, res: PartialResult) -> float:
        if self.average == "contributions":
            return 1 if self._mean_rounds() else res.count
        if self._world_rounds():
            return 1
        # the world the execution spanned: the world before a loss for a result of it that
        # this rank receives after the recovery
        return res.world_size or self.world_size

    def _step_lr(self, res: PartialResult) -> float:
        return self.lr

    # -- the step ----------------------------------------------------------------------------
    async def step(self, grads: Any) -> StepInfo:
        """Contribute this step's gradient, apply the update the collective returns.

        ``grads``: shaped like ``params`` (one flat array, or a sequence in parameter order).
        Returns a :class:`~asynccoll.train.StepInfo`. Raises what the collective raises
        (``CollectiveTimeoutError``, ``ExecutionError``, ``PeerLostError``).
        """
        g = self.bucket.flatten(grads, self._gbuf)
        if self._h is None:
            total = await self.comm.allreduce(g, timeout=self.timeout)
            self._apply(total, self.world_size, self.lr)
            self.steps += 1
            self.applied += self.world_size
            P = self.world_size
            return StepInfo(self.steps - 1, True, frozenset(range(P)), P, 0, self.lr,
                            fresh=frozenset(range(P)))
        if self._joining:  # a restarted rank's first step: receive the state (.joining)
            return await self._join_step()
        # A sync event planned ahead (taking a rank in: .joining) is held in this step's own
        # execution: every rank that learned of the plan flushes with its gradient in it
        planned = self._h.flush_planned
        if planned:
            res = await self._h.flush(self.timeout, g, combine=self._combine(), out=self._rbuf)
        else:
            res = await self._h(g, self.timeout, combine=self._combine(), out=self._rbuf)
        self._stale_run = 0 if res.included else self._stale_run + 1
        self.applied += res.count
        lr = self._step_lr(res)
        if res.count:
            self._apply(res.value, self._divisor(res), lr)
        self.steps += 1
        self._since_sync += 1
        stale = self._stale_run
        synced = False
        if planned or res.flushed \
                or (self.sync_every is not None and self._since_sync >= self.sync_every) \
                or (self.max_staleness is not None and stale > self.max_staleness) \
                or self._sync_wanted:
            await self._sync(finished=False, flushed=planned)
            synced = True
        if self._join_wanted() or self._sync_due_soon():  # (held in a step's own execution)
            self._h.plan_flush()
        return StepInfo(res.round, res.included, res.contributors, res.count, stale, lr,
                        res.missed, synced, res.fresh, res.lateness, res.latest_arrival,
                        res.deadline, res.deadline_expired)

    def _sync_due_soon(self) -> bool:
        """Whether ``sync_every`` comes due in two steps: plan the event now, so that every
        rank learns of it from the next execution and holds it in the step after, in that
        step's own execution (module doc); a rank that did not learn of it in time still
        triggers it when due. Not for ``sync_every=1``: every step is an event."""
        n = self.sync_every
        return n is not None and n >= 2 and self._since_sync >= n - 2

    def _apply(self, value: Any, divisor: float, lr: float) -> None:
        self.updater.apply(self.params, value.reshape(-1) / divisor, lr)

    async def _sync(self, *, finished: bool, average: bool = True,
                    flushed: bool = False) -> bool:
        """One sync event (module doc); returns whether every rank has finished.

        The parameter allreduce also carries two flags, so that every rank learns the same
        answers: how many ranks have finished, and whether any asked not to average.
        ``flushed``: the event's flush was the step's own (planned), its result applied.
        """
        assert self._h is not None
        if not flushed:
            res = await self._h.flush(self.timeout)
            self.applied += res.count
            if res.count:  # an empty round must not add a weight-decay or momentum step
                self._apply(res.value, self._divisor(res), self._step_lr(res))
        n = self.params.size
        self._sync_buf[:n] = self.params
        self._sync_buf[n] = 1.0 if finished else 0.0
        self._sync_buf[n + 1] = 0.0 if average else 1.0
        self._join_flags(self._sync_buf[n + 2:])
        self._sync_wanted = False
        now = self._comm_now()
        try:
            await self._settle_join()  # the last admission's digests compared (.joining)
            tot = await now.allreduce(self._sync_buf, timeout=self.timeout,
                                      out=self._sync_buf)
        except PeerLostError as exc:  # (in a job that survives losses: another event follows)
            self._lost_in_event(exc, "its parameters' allreduce", now)
            return False
        self._averaged = bool(tot[n + 1] == 0)
        if self._averaged:
            np.divide(tot[:n], self.world_size, out=self.params)
        self._since_sync = 0
        self._stale_run = 0
        self.syncs += 1
        done = bool(tot[n] >= self.world_size)
        if not done:  # take restarted ranks back, ready on every member (.joining)
            try:
                await self._admit_agreed(tot[n + 2:], equal=self._averaged)
            except PeerLostError as exc:
                self._lost_in_event(exc, "taking ranks back")
        return done

    async def finish(self, average: bool = True) -> None:
        """Collective: drain every contribution and (``average``) average the parameters,
        repeated until every rank has called it (ranks still stepping join the events it
        triggers). Call it once, after the last step, on every rank. Afterwards no gradient is
        left in flight and all replicas are equal to the bit: averaged (the allreduce's result,
        which every rank receives alike, divided alike), or, if any rank passed
        ``average=False``, rank 0's parameters given to every rank (one broadcast; with
        ``accumulate=True`` and plain SGD the ranks already held them up to rounding, which
        depends on how each rank's rounds were grouped into steps)."""
        if self._h is None:
            return
        while not await self._sync(finished=True, average=average):
            pass
        if not self._averaged:
            np.copyto(self.params, await self._comm_now().broadcast(self.params, 0,
                                                                     self.timeout))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(policy={self.policy!r}, lr={self.lr}, "
                f"rank={self.comm.rank}/{self.world_size}, steps={self.steps})")
