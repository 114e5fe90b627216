"""The hierarchical partial handle after a lost rank, with ``survive`` (DESIGN §6, §10).

:class:`Regrouping` is a part of :class:`~.hier_partial.HierPartialAllreduce`, in a module of
its own for size. The handle's life is cut into **epochs**: in each, its host groups, its
leaders' group and its leaders' partial handle (``survive=True``, so a lost leader is settled
by the flat survival, :mod:`.survival`) are fixed. A loss ends the epoch at an agreed point:
every survivor **regroups** once, and every rank of a host does so at the same call.

* **When.** A rank of a host that lost a member regroups when its host collective fails (every
  later one fails too, so the whole host does). A host that lost nobody regroups at the call
  after its leader learned of the loss: the leader says so in the header it hands to its
  ranks, so its ranks regroup at the same call; a flush asks the host afterwards (one small
  allreduce: its leaders' flush may have gone on without a lost leader) and then regroups
  and flushes again. The calls under way complete meanwhile: a host that waits on another
  host's leader is released by that leader's flush (step 1), which bypasses the quorum; a
  leader whose last use of the leaders' handle was a flush does not flush it again (the
  flushes pair up, one per leader). A call counts as a use from its start: a leader whose host
  step fails on a loss right after a flush boundary flushes in its regroup, which releases the
  other leaders' calls of that step (before, each leader waited on the other until the timeout).
* **How** (every survivor, in this order):

  1. the leaders of the epoch flush its leaders' handle: afterwards none of them holds a
     contribution and every surviving leader has had the same results (what the lost leader
     held, its send buffer or a snapshot that no survivor completed, is lost with it, as in
     the flat handle);
  2. the survivors agree on who is lost (``comm.shrink()``, again while the survivors lose
     more): the same set on every survivor, :mod:`.membership`;
  3. over the survivors' communicator: one allgather (each rank's host, its host steps done
     in the epoch, whether it leads, the next execution number) and one broadcast from the
     lowest surviving leader of its totals (step *Accounting*);
  4. new host groups (``split`` by the old host) and a new leaders' group: a host keeps its
     surviving ranks in order, its lowest the leader (a new one if the leader died); a host
     that lost every rank drops out;
  5. a new leaders' partial handle over the new leaders (its name carries the epoch; its
     quorum lowered to the hosts left), numbering continued from the old one's.

  **Why a new leaders' handle, not a join** (``PartialAllreduce.grow``): after step 1 nobody
  holds anything, so a new handle loses nothing and needs no joiner protocol; the new leader
  is a live member of the survivors' communicator that everyone already agrees on; and it is
  the same step whether leaders joined, left or stayed.
* **Accounting** (``Accumulate.SUM``, ``op="sum"``): every leader's contribution carries, after
  the data, one count per host (1 at its own host), so every result says how many host sums
  of each host are in it. Every rank keeps its host's sums not yet known counted (a copy per
  call, only with ``survive``). At the regroup the lowest surviving leader's totals (the sum
  of all its leaders' results, counts included) go to everyone: a host whose leader died
  learns how many of its sums were counted, and its new leader contributes the rest with its
  next call (in one sum, so ``count`` counts it once); the call under way is *done* when its
  host sum was counted or is in that rest, else it goes into the new epoch. Every rank hands
  out, with the call that regroups, the difference between those totals and what it has
  been handed of the epoch's results (and a difference not handed out yet, when a second loss
  came first; before, a second regroup subtracted the first epoch's results again). So each
  survivor's contributions are counted exactly once and every survivor ends with the same sum;
  what a lost rank had contributed is counted when its host sum got into a completed execution
  (or into its host's rest), else reported lost.
  With ``Accumulate.LATEST`` superseded results are dropped anyway: the regroup hands the
  last leaders' result to a call it settles, and what a lost leader held is lost.
* **What results say.** ``lost``: the ranks lost (the communicator's numbering), the same on
  every rank from the regroup on; ``world_size``: the ranks left. Between a loss and the
  regroup (at most the call under way and the next one on a host that lost nobody)
  ``contributors`` name only the hosts whose data is in the value. ``round`` goes on.

**Joining** (DESIGN §6, :mod:`.joining`): a restarted rank is taken back by the flat handles'
protocol, ``admit_ready(h, watch, state, meta)`` on the members right after ``await
h.flush()`` and ``join_handle(h, comm, state)`` on the restarted process; the handle offers what
that protocol uses (``communicator``, ``completed``: the latest round, ``timeout``, ``grow``).
``grow`` only records the grown membership; the next call or flush of every rank of it
**regrows**, collectively over it: each rank says its host (one allgather), the host groups are
made again (``split`` by host: the restarted rank is back in its host's group, whose lowest
rank leads, the old leader again if it was the one restarted), a new leaders' group and a new
leaders' partial handle (the next epoch), its rounds numbered on from the flush boundary. Nothing
is settled there: at a flush boundary nobody holds a contribution and every rank has been handed
every result. A rank lost before the regrow is left out by the same agreement as any loss (the
regrow runs over the grown membership's survivors); one lost in the middle of its splits is, as
for a regroup, not resolved.

Costs while nobody is lost: with ``survive`` one copy of the host sum per call on every rank,
one add of each result, and as many more elements per contribution as there are hosts.
Every wait is bounded by the handle's timeout. Known limits: a loss a host learns only after
its final flush returned is not regrouped there (its ranks have finished); the regroup's
collectives run over the survivors' communicator, among its other collectives in the same
order; a loss during the regroup's host broadcast (a host of three or more ranks losing a
second one then) is not resolved.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import numpy as np

from ..collectives.policy import Accumulate, Backup, Deadline, Policy, Quorum, Solo
from ..collectives.shm import host_groups
from ..errors import PeerLostError
from ..results import PartialResult
from .shm import host_hash

__all__ = ["Regrouping", "fitted"]

log = logging.getLogger("asynccoll.comm")


def fitted(policy: Policy, hosts: int) -> Policy:
    """``policy`` with its quorum lowered to ``hosts`` where it asks for more (as the flat
    handle lowers it for fewer survivors)."""
    try:
        policy.activation(hosts)
        return policy
    except ValueError:
        pass
    if isinstance(policy, Quorum):
        return dataclasses.replace(policy, k=hosts)
    if isinstance(policy, Deadline):
        return dataclasses.replace(policy, quorum=hosts)
    if isinstance(policy, Backup) and hosts > 1:
        return dataclasses.replace(policy, b=hosts - 1)
    return Solo()


class Regrouping:
    """The survival side of :class:`~.hier_partial.HierPartialAllreduce` (module doc); the
    handle's state is declared here for the type checker and set by the handle."""

    name: str
    policy: Policy
    _comm: Any
    _like: Any
    _options: dict[str, Any]
    _host: Any
    _handle: Any
    _hosts: list[list[int]]
    _closed: bool

    async def _setup(self, timeout: float | None) -> Any:
        raise NotImplementedError

    def _init_survival(self, survive: bool) -> None:
        self._survive = survive
        self._sums = survive and self._options.get("accumulate") is Accumulate.SUM
        self._base: Any = self._comm  # the communicator of the ranks not lost
        self._epoch = 0
        self._offset = 0  # the round of the leaders' handle's execution 0
        self._last_round = -1
        self._pending = False  # regroup before going on (module doc, "When")
        #: whether this leader's last use of its leaders' handle was a flush
        self.lead_flushed = False
        self._steps = 0  # host steps completed in this epoch
        self._kept: collections.deque[tuple[int, Any]] = collections.deque()
        self._seen = (0, 0)  # my host's sums counted in the results before the latest, in it
        self._resend: Any = None  # the rest of a host whose leader died (module doc)
        self._total: Any = None  # a leader's sum of its leaders' results (counts included)
        self._latest: Any = None  # a leader's latest leaders' result (LATEST)
        self._given: Any = None  # the sum of the values handed out here (SUM)
        self._catch_up: Any = None
        self.lost: frozenset[int] = frozenset()
        #: the communicator's ranks that ever were members (a rank outside, a vacant rank of
        #: a job that may grow, is not lost)
        self._ever: set[int] = set(range(self._comm.size))
        self.world_size = self._comm.size
        #: a membership that took ranks back, and its first round: the next call regrows
        self._grown: tuple[Any, int] | None = None

    # -- the leaders' contribution (with the counts) ------------------------------------------
    def leaders_like(self, n_hosts: int) -> Any:
        """What the leaders' handle is made for: ``like``, or with ``survive`` and sums its
        data flat followed by ``n_hosts`` counts."""
        if not self._sums:
            return self._like
        return np.zeros(self._like.size + n_hosts, self._like.dtype)

    def host_index(self) -> int:
        me = self._comm.rank
        return next(i for i, h in enumerate(self._hosts) if me in h)

    async def host_step(self, host: Any, x: Any, timeout: float | None) -> Any:
        """This call's host sum, as the leaders' handle takes it; kept until known counted."""
        op = self._options.get("op", "sum")
        if not self._sums:
            summed = await host.allreduce(x, op=op, timeout=timeout)
            self._steps += self._survive
            return summed
        n = self._like.size
        ext = np.zeros(n + len(self._hosts), self._like.dtype)
        await host.allreduce(x, op=op, timeout=timeout, out=ext[:n].reshape(self._like.shape))
        if self._resend is not None:
            ext[:n] += self._resend
            self._resend = None
        ext[n + self.host_index()] = 1
        self._steps += 1
        self._kept.append((self._steps, ext))
        return ext

    def took(self, res: PartialResult) -> tuple[Any, int]:
        """A leader got ``res`` from its leaders' handle: keep what the regroup needs; return
        the value to hand out and my host's count in it."""
        if not self._survive:
            return res.value, 0
        self._last_round = self._offset + res.round
        if not self._sums:
            self._latest = res.value
            return res.value, 0
        if self._total is None:
            self._total = np.zeros_like(res.value)
        self._total += res.value
        n = self._like.size
        return res.value[:n].reshape(self._like.shape), int(res.value[n + self.host_index()])

    def handed(self, pending: bool, mine: int, round_: int) -> None:
        """Every rank after a hand-out: the leader's flag (a loss is known: regroup at the
        next call) and my host's count in the result (its sums before it are counted)."""
        if not self._survive:
            return
        self._pending = self._pending or pending
        self._last_round = max(self._last_round, round_)
        before = self._seen[1]
        self._seen = (before, before + mine)
        while self._kept and self._kept[0][0] <= before:
            self._kept.popleft()

    def loss_known(self) -> bool:
        return self._base.membership.lost is not None

    def hand(self, res: PartialResult, settled: bool = False) -> PartialResult:
        """``res`` as handed to the caller: the regroup's catch-up added (sums), the loss
        reported. What the epoch's leaders' results handed here add up to is kept
        (``_given``: a settled result's value is the catch-up alone, of the epoch before)."""
        value = res.value
        if self._sums:
            if self._given is None:
                self._given = np.zeros_like(value)
            if not settled:
                self._given += value
            if self._catch_up is not None:
                value = self._catch_up if settled else value + self._catch_up
                self._catch_up = None
        return dataclasses.replace(res, value=value, lost=self.lost,
                                   world_size=self.world_size)

    # -- the regroup (module doc, "How") ------------------------------------------------------
    async def _survivors(self, timeout: float | None, base: Any = None) -> Any:
        s = await (self._base if base is None else base).shrink(timeout)
        while s.membership.lost is not None:  # lost more since: shrink that too
            s = await s.shrink(timeout)
        return s

    async def regroup(self, at: int, timeout: float | None) -> PartialResult | None:
        """Regroup (module doc); ``at``: the host step of this epoch the call under way makes.
        Returns the result of that call when the regroup settled it (its host sum counted
        or in its host's rest), else None (the call goes on in the new epoch). After an
        admission, regrow instead (:meth:`grow`)."""
        if self._grown is not None:
            await self._regrow(timeout)
            return None
        old = self._handle
        first = -1
        if old is not None:
            if not self.lead_flushed:  # (its last use a flush: nothing held, no second one)
                self.took(await old.flush(timeout))
            first = self._offset + old.completed + 1
        s = await self._survivors(timeout)
        me = self.host_index()
        info = np.array([me, self._steps, old is not None, first, self._last_round], np.int64)
        got = await s.allgather(info, timeout)
        led = [i for i in range(s.size) if got[i, 2]]
        src = led[0] if led else -1
        first = max(int(got[:, 3].max()), int(got[:, 4].max()) + 1)
        n = self._like.size
        if self._sums:
            payload = np.zeros(n + len(self._hosts), self._like.dtype)
            if s.rank == src:
                payload[...] = self._total if self._total is not None else 0
        else:
            payload = np.zeros_like(self._like)
            if s.rank == src and self._latest is not None:
                payload[...] = self._latest
        if src >= 0:
            payload = await s.broadcast(payload, src, timeout)
        cm = list(self._comm.members)
        alive = [cm.index(m) for m in s.members]  # comm rank of each survivor (by rank in s)
        hosts = [[r for r in h if r in alive] for h in self._hosts]
        keep = [i for i, h in enumerate(hosts) if h]
        host = await s.split(me, timeout=timeout)
        lead = await s.group([alive.index(hosts[i][0]) for i in keep], timeout)
        steps = int(got[alive.index(hosts[me][0]), 1])  # my new leader's host steps
        if not self._sums:
            counted = 0
        elif src >= 0:
            counted = int(payload[n + me])
        else:  # every leader lost at once: count what this host was handed
            counted = self._seen[1]
        rest = None
        if self._sums and steps > counted:
            mine = np.zeros_like(self._like.reshape(-1))
            if hosts[me][0] == self._comm.rank:
                for j, ext in self._kept:
                    if counted < j <= steps:
                        mine += ext[:n]
            rest = await host.broadcast(mine, 0, timeout)
        # -- commit --------------------------------------------------------------------------
        if old is not None:
            await old.close()
        self._base, self._host, self._epoch = s, host, self._epoch + 1
        self._hosts = [hosts[i] for i in keep]
        self._handle = None if lead is None else lead.partial_allreduce(
            fitted(self.policy, len(keep)), self.leaders_like(len(keep)),
            name=f"{self.name}/leaders@{self._epoch}", **self._options)
        self._offset, self._steps, self._seen = first, 0, (0, 0)
        self.lead_flushed = False
        self._kept.clear()
        self._resend = rest
        self.lost = frozenset(r for r in self._ever if r not in alive)
        self.world_size = s.size
        self._total = self._latest = None
        if self._sums:
            # what the epoch's results add up to, less what was handed out of them here (and
            # a catch-up of an earlier regroup not handed out yet: a loss came first)
            total = payload[:n].reshape(self._like.shape)
            given = 0 if self._given is None else self._given
            owed = 0 if self._catch_up is None else self._catch_up
            self._catch_up = total - given + owed
            self._given = None
        log.warning("rank %d: hierarchical partial allreduce %r goes on with %d hosts, %d "
                    "ranks (lost %s) from round %d", self._comm.rank, self.name, len(keep),
                    s.size, sorted(self.lost), first)
        if max(steps, counted) < at:
            return None
        value = payload[:n].reshape(self._like.shape) if self._sums else payload
        # the surviving ranks of the hosts with a host sum in the epoch that ended
        contributors = frozenset(r for i, h in enumerate(hosts) for r in h
                                 if not self._sums or payload[n + i] > 0)
        return PartialResult(value, first - 1, counted >= at, contributors, 0,
                             flushed=True, world_size=s.size, lost=self.lost)

    # -- taking restarted ranks back (module doc, "Joining") -----------------------------------
    @property
    def communicator(self) -> Any:
        """The communicator of the ranks the handle runs on now (the survivors' after a loss,
        the grown one after a join); None for a handle that does not survive losses (it cannot
        take ranks back either)."""
        return self._base if self._survive else None

    @property
    def completed(self) -> int:
        """The latest round handed out on this rank (-1 before the first): at a flush
        boundary the same on every rank of every host."""
        return self._last_round

    @property
    def timeout(self) -> float | None:
        """The default timeout of the handle's calls (None: the communicator's)."""
        t: float | None = self._options.get("timeout")
        return t

    def grow(self, comm: Any, first: int, ranks: list[int]) -> None:
        """Go on over ``comm``, a membership that took lost ranks back (module doc, "Joining"),
        from round ``first``: recorded here (on any thread); the next call or flush of every
        rank of ``comm`` regrows, collectively over it (:meth:`_regrow`). Called at a flush
        boundary (nobody holds a contribution), on every member with the same ``comm`` and
        ``first``, and on a joiner's new handle. ``ranks`` (the new rank of each old one) is
        the flat handle's argument, not needed here. Raises ``ValueError`` for a handle that
        does not survive losses or whose communicator does not hold ``comm``'s ranks."""
        if not self._survive:
            raise ValueError(f"hierarchical partial allreduce {self.name!r} does not survive "
                             "losses (survive=True), so it cannot take ranks back")
        mine = tuple(self._comm.members)
        # a job that grew: ranks beyond the first world's (Grouping.first_world), whose ranks
        # are the job's
        first_world = bool(getattr(self._comm, "is_first_world", False))
        if not set(comm.members) <= set(mine) and not (
                first_world and set(comm.members) <= set(range(self._comm.job.size))):
            raise ValueError(f"hierarchical partial allreduce {self.name!r}: the grown "
                             f"membership {list(comm.members)} is not among its "
                             f"communicator's ranks {list(mine)}")
        self._grown = (comm, first)
        self._pending = True
        self.world_size = comm.size  # (as the flat handle's; the regrow says it again)

    async def _regrow(self, timeout: float | None) -> None:
        """The growth :meth:`grow` recorded, collective over the grown membership (its ranks
        still alive: a rank lost meanwhile is left out, agreed as after any loss): every rank
        says its host; new host groups (the lowest rank of each host its leader) and a new
        leaders' group; a new leaders' handle for the next epoch (the number agreed: the
        highest plus one), its rounds from ``first`` on. Nothing is settled: at a flush
        boundary nobody holds a contribution and every rank has been handed every result, so
        the new epoch starts with nothing owed but a catch-up not handed out yet."""
        assert self._grown is not None
        grown, first = self._grown
        s = grown if grown.membership.lost is None else await self._survivors(timeout, grown)
        if not set(s.members) <= set(self._comm.members):
            # the job grew beyond the first world (grow): its ranks are the job's, so the
            # handle numbers by the job's communicator from now on, the same numbers
            self._comm = self._comm.job
        if self._host is None and self._epoch == 0:
            self._ever = set()  # a handle that never ran (a joiner's): it learns the others'
        # every rank says its host, its epoch, and the ranks that ever were members as it
        # knows them (a joiner nothing): the union, the same on every rank, is what ``lost``
        # is reported from
        ever = np.zeros(self._comm.size, np.int64)
        ever[sorted(self._ever)] = 1
        got = await s.allgather(np.concatenate([[host_hash(), self._epoch], ever]), timeout)
        epoch = int(got[:, 1].max()) + 1
        groups = host_groups(got[:, 0].tolist())  # ranks of s
        cm = list(self._comm.members)
        alive = [cm.index(m) for m in s.members]  # comm rank of each rank of s
        self._ever = set(np.flatnonzero(got[:, 2:].max(axis=0)).tolist()) | set(alive)
        host = await s.split("host", timeout=timeout)
        lead = await s.group([g[0] for g in groups], timeout)
        # -- commit --------------------------------------------------------------------------
        if self._handle is not None:
            await self._handle.close()  # (flushed: it holds nothing)
        self._base, self._host, self._epoch, self._grown = s, host, epoch, None
        self._hosts = [[alive[r] for r in g] for g in groups]
        self._handle = None if lead is None else lead.partial_allreduce(
            fitted(self.policy, len(groups)), self.leaders_like(len(groups)),
            name=f"{self.name}/leaders@{epoch}", **self._options)
        self._offset, self._steps, self._seen = first, 0, (0, 0)
        self._last_round = max(self._last_round, first - 1)
        self.lead_flushed = False
        self._kept.clear()
        self._resend = None
        self._total = self._latest = self._given = None
        self.lost = frozenset(r for r in self._ever if r not in alive)
        self.world_size = s.size
        log.warning("rank %d: hierarchical partial allreduce %r goes on with %d hosts, %d "
                    "ranks (lost %s) from round %d", self._comm.rank, self.name, len(groups),
                    s.size, sorted(self.lost), first)

    async def surviving(self, attempt: Any, at: int, timeout: float | None,
                        flush: bool = False) -> PartialResult:
        """Run ``attempt()`` (a call or flush of this epoch), regrouping first when a loss
        is pending and again whenever a host collective fails on a loss (module doc). A
        flush asks its host afterwards whether a rank knows of a loss (its leaders' flush may
        have gone on without a lost leader): then it regroups and flushes again, and returns
        both (summed, or the latest)."""
        carried: PartialResult | None = None
        while True:
            try:
                if self._pending:
                    settled = await self.regroup(at, timeout)
                    self._pending = False
                    at = self._steps + 1
                    if settled is not None and not flush:
                        return self.hand(settled, settled=True)
                res = self.hand(await attempt())
                if carried is not None and self._sums:
                    res = dataclasses.replace(res, value=carried.value + res.value)
                if not flush:
                    return res
                carried = res
                host = await self._setup(timeout)
                flag = await host.allreduce(np.array([self.loss_known()], np.int64), "max",
                                            timeout=timeout)
                if not flag[0]:
                    return res
                self._pending = True
            except PeerLostError:
                if self._closed:
                    raise
                self._pending = True
