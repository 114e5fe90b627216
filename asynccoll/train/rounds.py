"""Synchronous rounds that go on without a lost rank and take a restarted one back: the
engine of :class:`~.odsgd.ODSGD` and :class:`~.topk_sgd.TopKSGD` (docs/training.md, *A lost
rank*; docs/groups.md, *Joining*).

A **round** is one synchronous collective of a step's contribution (OD-SGD's allreduce of a
gradient, top-k SGD's sparse allreduce) over the ranks training now, numbered from 0 in the
order the steps issue them; every rank applies every round's result once, in order, divided
by the number of ranks the round ran over. As torchft's ``Manager`` does, the step is
synchronous over the current members; a loss shrinks them and a restarted rank is admitted at
a step boundary.

**A loss** (``comm.survive``, as under ``asynccoll run --max-failures N``): the round under way
raises :class:`~asynccoll.PeerLostError` on the survivors, at different rounds (a survivor may
have completed round ``k`` with the lost rank's data in it while another failed in it: an
allreduce completes once every rank's data reached this rank, and each rank runs its rounds
one after the other, so the survivors' completed counts differ by one at most). Every
survivor then

1. agrees on who is lost and takes the survivors' communicator (``comm.shrink()``);
2. settles: one allgather of each survivor's count of completed rounds; when they differ, the
   lowest survivor that completed round ``k`` broadcasts its result (the full sum, with the
   lost rank's contribution, divided by the world it ran over) and the others apply it as if
   it had arrived. *Decision*: a round that some survivor completed is never redone, so no
   survivor applies an update twice or a different one;
3. redoes every round it issued that nobody completed, over the survivors: the same
   contributions (kept until their round completes) re-reduced without the lost rank and
   divided by the survivors' number (torchft: divide by the number that contributed). The
   lost rank's contribution to such a round is lost with it.

A loss during the recovery starts it again over the survivors of the survivors. Nothing here
costs anything while nobody is lost: the contributions are kept by reference, the latest
result too. Without ``survive`` a loss raises, as before. *Known limit*: a loss during the very
last round, after some survivor returned from ``finish()``, leaves the others waiting for it in
the recovery until their timeout (nobody is left to settle with).

**A join** (:mod:`asynccoll.comm.joining`): each round also sums one ready flag per rank of the
job (``TakesJoinersBack``: P extra entries of the allreduce; for the sparse allreduce, one
entry per ready rank, none while nobody is ready), so the ranks ready on every member that ran
the round are known alike everywhere, without a collective of their own. At the end of the
step that processed such a round, the members wait for the round still in flight (OD-SGD's;
that step loses its overlap), so no round is in flight, and admit the joiners: a communicator
of the grown membership, the replicated state striped to the joiners and checked by a digest
on every rank, the round and step counters in the meta data. The joiner's first step receives
it (its gradient, computed on parameters it had not yet received, is not contributed) and
returns with ``StepInfo.joined``; from its next step it contributes, and ``step_count`` is the
global step. *Decision*: the state and the digest cover only what is equal on every member
(the replicated parameters and the momentum of their update rule); what is per rank (OD-SGD's
local weights and the local updater's state, top-k's error-feedback residual) starts afresh on
the joiner (zero residual, local weights equal to the global ones).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm import joining
from ..comm.communicator import Communicator
from ..errors import ExecutionError, PeerLostError
from .joining import TakesJoinersBack

__all__ = ["SyncRounds"]

log = logging.getLogger("asynccoll.train")


class _Link:
    """The :class:`asynccoll.comm.joining.Joinable` of a class that has no handle (its rounds
    are synchronous collectives): a name for the joining channel, the rounds completed (the
    admission's key), a timeout, and ``grow`` (remember the grown communicator: the class's
    rounds go there next)."""

    def __init__(self, name: str, timeout: float | None) -> None:
        self.name = name
        self.timeout = timeout
        self.completed = 0
        self.grown: Communicator | None = None

    def grow(self, comm: Communicator, first: int, ranks: list[int]) -> None:
        self.grown = comm


@dataclass
class _Round:
    """One round issued and not yet applied here."""

    payload: Any  #: this rank's contribution (kept: a redo sends it again)
    comm: Communicator  #: where it runs
    fut: asyncio.Future[Any]  #: its result: the full-length dense sum


class SyncRounds(TakesJoinersBack):
    """The rounds of a synchronous training class (module doc). The class calls
    :meth:`_rounds_init` once its state exists, :meth:`_issue` and :meth:`_complete` in its
    steps, :meth:`_admit_pending` at the end of each step and in ``finish``; it provides
    :meth:`_start` (the round's collective), :meth:`_apply_round` and :meth:`_template`."""

    steps: int
    _now: Communicator
    _link: _Link
    _rounds: deque[_Round]
    _done: int  # rounds applied here
    _last: Any  # the latest applied round's result (a survivor that lost it receives it)
    _admitting: set[int]  # ranks agreed ready by an applied round, not yet admitted
    _members: tuple[int, ...]  # the job ranks of the latest applied round

    # -- what the class provides ------------------------------------------------------------
    async def _start(self, comm: Communicator, payload: Any) -> Any:
        """Run one round of ``payload`` over ``comm``; return the dense sum (a new array)."""
        raise NotImplementedError

    def _apply_round(self, total: Any, size: int) -> None:
        """Apply a round's summed contributions (``total``, without the flags) over ``size``
        ranks."""
        raise NotImplementedError

    def _template(self) -> Any:
        """An array shaped like a round's result (what a settling broadcast receives into)."""
        raise NotImplementedError

    def _switch(self, comm: Communicator) -> None:
        """The rounds run on ``comm`` from now on (after a shrink or a grow)."""
        self._now = comm

    # -- set-up ---------------------------------------------------------------------------
    def _rounds_init(self, name: str) -> None:
        self._now = self.comm
        self._h = None
        self._link = _Link(name, self.timeout)
        self._rounds = deque()
        self._done = 0
        self._last = None
        self._admitting = set()
        self._members = self.comm.members
        self._join_init()

    def _handle(self) -> Any:  # (what the joining protocol uses of a handle: _Link)
        return self._link

    def _comm_now(self) -> Communicator:
        return self._now

    @property
    def world_size(self) -> int:
        """The ranks training now: the job's size, the survivors' after a loss, the grown
        world after a join."""
        return self._now.size

    def _join_meta(self) -> dict[str, Any]:
        return {"steps": self.steps, "round": self._done}

    def _restore(self, meta: dict[str, Any]) -> None:
        self.steps = int(meta.get("steps", 0))
        self._done = int(meta.get("round", 0))
        assert self._link.grown is not None
        self._switch(self._link.grown)
        self._members = self._now.members

    # -- rounds ---------------------------------------------------------------------------
    def _issue(self, payload: Any) -> None:
        """Start the next round with this rank's ``payload`` over the ranks training now."""
        fut = asyncio.ensure_future(self._start(self._now, payload))
        self._rounds.append(_Round(payload, self._now, fut))

    async def _complete(self) -> None:
        """Wait for the oldest round issued and apply it; after a loss (``survive``), recover
        first (module doc), which may apply it (settled) or issue it again."""
        while True:
            r = self._rounds[0]
            try:
                total = await r.fut
            except PeerLostError:
                if not self.comm.survive:
                    raise
                await self._recover()
                if not self._rounds or self._rounds[0] is not r:
                    return  # settled: another survivor had completed it
                continue
            self._apply(self._rounds.popleft(), total)
            return

    def _apply(self, r: _Round, total: Any) -> None:
        n = total.size - self._join_slots()
        self._apply_round(total[:n], r.comm.size)
        self._done += 1
        self._last = total
        self._members = r.comm.members
        if self._joiners is not None:
            self._admitting.update(self._joiners.agreed(total[n:], r.comm.members))

    async def _recover(self) -> None:
        """Steps 1-3 of the module doc, again for each loss learned meanwhile. Raises
        :class:`~asynccoll.PeerLostError` when the survivors decided this rank is lost,
        :class:`~asynccoll.CollectiveTimeoutError` when a survivor does not take part."""
        while True:
            # every round still pending ran on the communicator that lost a rank: failed, or
            # fails at once (a call started after a loss raises)
            await asyncio.gather(*(r.fut for r in self._rounds), return_exceptions=True)
            # (PeerLostError from shrink: the survivors decided this rank is lost)
            now = await self._now.shrink(self.timeout)
            self._switch(now)
            try:
                counts = (await now.allgather(np.array([self._done], np.int64),
                                              self.timeout))[:, 0]
                top, low = int(counts.max()), int(counts.min())
                if top - low > 1:
                    raise ExecutionError(f"rank {self.comm.rank}: the survivors' completed "
                                         f"rounds differ by more than one ({counts.tolist()})")
                if top > low:
                    root = int(np.flatnonzero(counts == top)[0])
                    mine = self._last if self._done == top else np.empty_like(self._template())
                    got = await now.broadcast(mine, root, self.timeout)
                    if self._done < top:
                        self._apply(self._rounds.popleft(), got)
                        log.warning("rank %d: %s settled round %d with rank %d's result",
                                    self.comm.rank, type(self).__name__, top - 1,
                                    now.members[root])
                for r in self._rounds:
                    r.comm = now
                    r.fut = asyncio.ensure_future(self._start(now, r.payload))
            except PeerLostError:
                continue
            log.warning("rank %d: %s goes on over ranks %s from round %d (%d round(s) "
                        "redone)", self.comm.rank, type(self).__name__, list(now.members),
                        self._done, len(self._rounds))
            return

    # -- admission ------------------------------------------------------------------------
    async def _admit_pending(self) -> None:
        """At a step boundary: when an applied round agreed on ready ranks, wait for the
        rounds in flight and take those ranks back (module doc)."""
        if not self._admitting:
            return
        while self._rounds:
            await self._complete()
        joiners = sorted(self._admitting - set(self._now.members))
        self._admitting.clear()
        if not joiners:
            return
        self._link.completed = self._done
        self._link.grown = None
        try:
            grown = await joining.admit(self._link, self._now, joiners, self._state(),
                                        self._join_meta())
        except PeerLostError:
            if self._link.grown is None or not self.comm.survive:
                raise
            # a member lost during the admission: go on over the grown world's survivors
            self._switch(self._link.grown)
            await self._recover()
            return
        self._switch(grown)
