"""RNA: non-blocking allreduce with a two-choice initiator (*Mitigating Stragglers in the
Decentralized Training on Heterogeneous Clusters*, §3.2-3.3).

* **Initiator** (§3.2): two ranks drawn per round, the first to arrive starts it
  (``two_choice`` partial allreduce).
* **Averaging by contributors** (§3.3, Algorithm 2): with ``w_k = 1`` for every rank that had
  a gradient in the round, the update is ``W * sum(g)`` with ``W = 1 / sum(w)``.
* **Learning rate scaled by contributors** (§3.3, linear scaling rule): ``lr_k = sum(w) * gamma``.
  Here ``lr`` is the rate of a full round, ``gamma = lr / P``, so with every rank contributing
  the step is exactly synchronous SGD with ``lr``.
* **Staleness-weighted local accumulation** (§3.3): a rank whose earlier gradients still wait in
  the send buffer contributes their weighted mean ``g' = sum(w_t g_t) / sum(w_t)`` with
  ``w_t = t - (k - tau) + 1`` (``tau``: the largest gap, so the oldest weighs 1 and newer ones
  linearly more). Weights of entries already in the buffer do not change when a newer one
  arrives, so the buffer is updated in place as a running weighted mean, atomically with the
  collective's snapshots (the partial allreduce's ``combine`` hook). Each rank therefore counts
  once per round (``count`` = contributors).
* **Bounded staleness** (§3.3): a waiting gradient more than ``staleness_bound`` steps old is
  dropped from the send buffer; those within the bound stay (re-weighted, since the oldest kept
  one now weighs 1). Dropping one entry of a running mean needs that entry, so with a bound the
  handle keeps a copy of each waiting gradient (at most ``staleness_bound + 1`` of them, one
  gradient's copy per step) and recomputes the weighted mean from them, a few vector operations
  per waiting gradient; without a bound (``None``) nothing is ever dropped and the running mean
  needs no copies.

Model synchronisation and the staleness-triggered synchronous step work as in
:class:`~asynccoll.train.EagerSGD`.

**Hierarchical groups** (§4, ``groups=``): RNA inside each group, an asynchronous averaging of
the group models among the group leaders (a ``solo`` partial allreduce of their progress, see
:mod:`asynccoll.train.hier`), used only while the measured spread of the ranks' processing
times exceeds ``threshold`` times their mean; flat RNA otherwise. See :class:`RNA`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ..collectives.policy import Policy, TwoChoice, as_policy, moved_arguments
from ..comm.communicator import Communicator
from ..results import PartialResult
from ._staleness import check_staleness_bound, staleness_combine
from .eager import MOVED, EagerSGD
from .hier import DUE, FINISHING, HAS, TIME, Hierarchy, check_groups, check_threshold, decide
from .info import StepInfo

__all__ = ["RNA"]


class RNA(EagerSGD):
    """RNA training (module doc). Arguments as :class:`EagerSGD`; ``policy``: RNA's
    ``TwoChoice()`` by default (its seed: ``TwoChoice(seed=...)``), another partial policy runs
    RNA's averaging and staleness weights over it (``Sync()`` is refused: ``ValueError``
    naming ``policy``); plus ``staleness_bound`` (steps; ``None``: unbounded) and the
    hierarchy's:

    * ``groups``: ``None`` (flat RNA only), a list of rank lists partitioning the ranks of
      ``comm`` (group rank 0, the first listed, leads), an int n (n contiguous blocks) or
      ``"host"`` (one group per host, as ``comm.split("host")``).
    * ``threshold`` (>= 0, default 1.0, the paper's ``zeta > v``): the hierarchy runs while the
      spread ``zeta`` of the ranks' mean processing times exceeds ``threshold`` times their
      mean ``v``; 0 means always (from the first step), ``inf`` never.
    * ``check_interval`` (seconds, default 2.0): how often the ranks measure ``zeta``.
    * ``exchange_every`` (steps, default 4): how often a group exchanges with the others.

    The groups are made **lazily, in the first** :meth:`step` (or :meth:`finish`): making them
    is collective over ``comm`` and asynchronous, so the constructor stays synchronous like the
    other optimisers'; the first step of every rank therefore waits for all ranks' first step.
    Raises ``ValueError`` naming a bad argument.

    Costs per rank with ``groups``: in hierarchical mode, every ``exchange_every`` steps at
    most one ``solo`` execution in the group (a leader: one more among the leaders); every
    ``check_interval`` seconds, in either mode, one allgather of four numbers per rank,
    preceded in hierarchical mode by a rendezvous of the group (its RNA and correction channel
    are flushed), in flat mode by a sync event (which averages the parameters); a switch also
    drains the handles of the mode left (one flush each and, when leaving the hierarchy, one
    allreduce of the parameters).
    """

    @moved_arguments(**MOVED)
    def __init__(self, comm: Communicator, params: Any, lr: float, *,
                 policy: Policy | str = TwoChoice(),
                 staleness_bound: int | None = 4, momentum: float = 0.0,
                 weight_decay: float = 0.0, accumulate: bool = False,
                 sync_every: int | None = None, max_staleness: int | None = None,
                 name: str = "rna",
                 timeout: float | None = None, groups: Any = None, threshold: float = 1.0,
                 check_interval: float = 2.0, exchange_every: int = 4) -> None:
        check_staleness_bound(staleness_bound)
        if not as_policy(policy).partial:
            raise ValueError("policy Sync() is no partial allreduce: RNA takes TwoChoice() or "
                             "another partial policy")
        layout = None if groups is None or not isinstance(comm, Communicator) else \
            check_groups(groups, comm.size)
        self.threshold = check_threshold(threshold)
        if isinstance(check_interval, bool) or not isinstance(check_interval, (int, float)) \
                or not check_interval > 0:
            raise ValueError(f"check_interval must be a number of seconds > 0, "
                             f"got {check_interval!r}")
        if isinstance(exchange_every, bool) or not isinstance(exchange_every, int) \
                or exchange_every < 1:
            raise ValueError(f"exchange_every must be an int >= 1, got {exchange_every!r}")
        super().__init__(comm, params, lr, policy, momentum=momentum,
                         weight_decay=weight_decay, accumulate=accumulate,
                         average="contributions", sync_every=sync_every,
                         max_staleness=max_staleness, name=name, timeout=timeout)
        self.staleness_bound = staleness_bound
        #: the steps whose gradients the send buffer holds (a weighted mean), with a copy of each
        #: gradient when a staleness bound may drop one of them (else None)
        self._pending: list[tuple[int, Any]] = []
        self.groups = layout  #: the validated ``groups`` (None: flat RNA only)
        self.check_interval = float(check_interval)
        self.exchange_every = exchange_every
        self.hierarchical = False  #: whether the hierarchy is in use now
        self.switches = 0  #: mode switches so far
        #: ``(zeta, v)`` of the latest decision, seconds (None before the first)
        self.spread: tuple[float | None, float | None] | None = None
        self.hier: Hierarchy | None = None  #: the hierarchy, once made (first step)
        #: the group optimizer's arguments (it is made with the groups, in the first step)
        self._kw: dict[str, Any] = {
            "staleness_bound": staleness_bound, "momentum": momentum,
            "weight_decay": weight_decay, "accumulate": accumulate, "sync_every": sync_every,
            "max_staleness": max_staleness, "policy": self.policy, "name": f"{name}/group",
            "timeout": timeout}
        self._name = name
        self._finishing = False
        self._since_exchange = 0
        self._returned: float | None = None  # when the previous step returned
        self._win_time = 0.0
        self._win_n = 0
        self._checked = time.perf_counter()

    def _combine(self) -> Any:
        return staleness_combine(self.steps, self._pending, self.staleness_bound)

    def _mean_rounds(self) -> bool:
        # Averaging by contributors with the lr scaled by them: per round the step is
        # lr * c/P * sum/c = lr * sum / P, so summed rounds need no per-round averaging.
        return False

    def _divisor(self, res: PartialResult) -> float:
        # W = 1 / sum(w): each contributing rank counts once (its weighted mean).
        return len(res.contributors)

    def _step_lr(self, res: PartialResult) -> float:
        return self.lr * len(res.contributors) / self.world_size

    # -- hierarchical groups (RNA §4) --------------------------------------------------------
    async def _setup(self) -> Hierarchy:
        if self.hier is None:
            assert self.groups is not None
            self.hier = await Hierarchy.build(
                self.comm, self.groups, lambda g: RNA(g, self.params, self.lr, **self._kw),
                self.params, self._name, self.timeout)
            self._checked = time.perf_counter()
            if self.threshold == 0 and len(self.hier.members) > 1:
                self.hierarchical = True
                self.hier.start()
        return self.hier

    async def step(self, grads: Any) -> StepInfo:
        """As :meth:`EagerSGD.step`; with ``groups``, also the hierarchy's work (class doc).
        In hierarchical mode the returned ``round``, ``contributors`` and ``fresh`` are the
        group's RNA round and its members (as ranks of ``comm``)."""
        if self.groups is None:
            return await super().step(grads)
        now = time.perf_counter()
        if self._returned is not None:
            self._win_time += now - self._returned
            self._win_n += 1
        h = await self._setup()
        info: StepInfo
        if self.hierarchical:
            info = await h.opt.step(grads)
            info = dataclasses.replace(info, contributors=h.job_ranks(info.contributors),
                                       fresh=h.job_ranks(info.fresh))
            self.steps += 1
            self._since_exchange += 1
            if self._since_exchange >= self.exchange_every:
                self._since_exchange = 0
                await h.exchange()
            if self._due():
                await self._rendezvous()
                await self._decide()
                info = dataclasses.replace(info, synced=True)
        else:
            info = await super().step(grads)
            if not info.synced and self._due():
                await self._sync(finished=False)  # the others join it; a decision follows
        self._returned = time.perf_counter()
        return info

    def _due(self) -> bool:
        return time.perf_counter() - self._checked >= self.check_interval

    async def _rendezvous(self) -> None:
        """Collective over the group: every member stops stepping, the group's RNA and the
        correction channel are drained (afterwards the group's replicas agree)."""
        assert self.hier is not None
        await self.hier.opt.finish(average=False)
        await self.hier.deliver()

    async def _sync(self, *, finished: bool, average: bool = True,
                    flushed: bool = False) -> bool:
        # Flat mode: every sync event (the same sequence on every rank) is followed by one
        # switch check, so the check's allgather meets the same allgather everywhere, and no
        # rank waits in it for a rank stuck in a round that only a waiting rank could start.
        done = await super()._sync(finished=finished, average=average, flushed=flushed)
        if self.groups is not None:
            await self._decide()
        return done

    async def _decide(self) -> bool:
        """Collective over ``comm``: allgather the switch table, apply :func:`decide`;
        returns whether every rank is finishing."""
        mine = np.zeros(4)
        mine[TIME] = self._win_time / self._win_n if self._win_n else 0.0
        mine[HAS] = float(self._win_n > 0)
        mine[FINISHING] = float(self._finishing)
        mine[DUE] = float(self._due())
        table = await self.comm.allgather(mine, self.timeout)
        verdict = decide(table, self.threshold, self.hierarchical)
        if table[:, DUE].any():  # a new interval starts on every rank at once
            self._win_time, self._win_n = 0.0, 0
            self._checked = time.perf_counter()
        if verdict is None:
            return bool(table[:, FINISHING].all())
        hier, zeta, v = verdict
        self.spread = (zeta, v)
        assert self.hier is not None
        if len(self.hier.members) < 2 or hier == self.hierarchical:
            return False
        if hier:  # the sync event before this check drained the flat handle
            self.hier.start()
        else:  # the rendezvous drained each group's RNA; now the exchange and the channel
            await self.hier.drain()
            tot = await self.comm.allreduce(self.params, timeout=self.timeout)
            np.divide(tot, self.world_size, out=self.params)
        self.hierarchical = hier
        self._since_exchange = 0
        self.switches += 1
        return False

    async def finish(self, average: bool = True) -> None:
        """As :meth:`EagerSGD.finish`. With ``groups`` in hierarchical mode it first repeats
        group rendezvous and switch checks until every rank has called it, then pushes and
        delivers every group's remaining progress (:meth:`Hierarchy.drain`), so that even with
        ``average=False`` the replicas agree, to rounding (with ``accumulate=True`` and plain
        SGD)."""
        if self.groups is None:
            await super().finish(average)
            return
        h = await self._setup()
        self._finishing = True
        if self.hierarchical:
            while True:
                await self._rendezvous()
                if await self._decide():
                    break
            await h.drain()
        await super().finish(average)
