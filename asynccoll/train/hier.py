"""Hierarchical RNA (RNA §4): groups, the leaders' asynchronous exchange, the switch condition.

:class:`~asynccoll.train.RNA` with ``groups=`` uses this module; docs/training.md
("Hierarchical RNA") describes the method, this doc the accounting.

**Layout.** The ranks are partitioned into groups; group rank 0 is its *leader*. Every rank
holds a sub-communicator of its group (RNA runs on it) and a *correction channel* on it; the
leaders hold a communicator of the leaders and an *exchange* handle on it. The channel and
the exchange are ``solo`` partial allreduces with ``accumulate=True``: a call never waits for
another rank's caller (the first arrival starts an execution; the others' runtimes answer it),
and every contribution reaches every caller exactly once, in the first result it asks for
after the execution that carried it.

**The exchange (the parameter server, made a partial collective).** The paper pushes each
group's model to a central server that averages it and sends it back. Here every
``exchange_every`` steps a leader pushes ``w * delta``: its group's progress since its previous
push (``delta = params - ref``, ``ref`` following the parameters minus unpushed progress) at
the group's weight ``w = |group| / P``. What the exchange returns is the sum of every leader's
pushes not yet given to this leader, its own among them (one counter slot per leader says how
many of its own came back, so it can tell them apart). The group's model then moves by the
*correction* ``C = others - (1 - w) * delta``: the other groups' weighted progress in, and its
own progress scaled to its weight. So after every push has reached every leader, each group's
model is ``x0 + sum over all pushes of w_g * delta`` — the average of the group models,
weighted by group size — and no push is lost or counted twice. A leader never waits for
another leader (``solo``); a slow leader's push waits in its send buffer and goes out with the
fast leader's next execution. ``majority`` or ``two_choice`` among the leaders would make a
fast leader wait for a drawn slow one in half or more of the executions: exactly the
deterministic slowdown the hierarchy exists to avoid.

**Inside the group.** The leader hands ``C`` to the correction channel; the other members
call it with zeros at their own exchange steps. Every member (the leader too) applies what the
channel returns, so every member applies every correction exactly once; with the group's RNA
at ``accumulate=True`` and plain SGD the group's replicas agree (to rounding) whenever the
channel and the group's RNA are drained (at each switch check and after ``RNA.finish``).

**Switch condition (§4).** Each rank measures its *processing time*: the time between the
return of one ``step`` and the next call (the caller's compute; the collectives inside ``step``
are not in it, so the measure does not depend on the mode). Every ``check_interval`` seconds
the ranks allgather their mean over the window; with ``zeta`` the spread (max - min) and ``v``
the mean over ranks, the hierarchy runs while ``zeta > threshold * v`` (the paper: ``zeta > v``,
``threshold = 1``). :func:`decide` is that rule, a pure function of the allgathered table, so
every rank reaches the same verdict.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives.policy import Accumulate, Solo
from ..comm.communicator import Communicator

__all__ = ["Hierarchy", "check_groups", "check_threshold", "decide"]

#: columns of the allgathered switch table: mean processing time (s), whether the rank has a
#: measurement, whether it is finishing, whether its check interval has elapsed
TIME, HAS, FINISHING, DUE = range(4)


def check_groups(groups: Any, size: int) -> list[list[int]] | str:
    """``groups`` checked against a world of ``size`` ranks: a list of rank lists that
    partitions ``0..size-1`` (no empty group), an int n (n contiguous blocks, ``1 <= n <=
    size``) or ``"host"``. Returns the partition (``"host"`` as is: it is resolved
    collectively). Raises ``ValueError`` naming ``groups``."""
    if isinstance(groups, str):
        if groups != "host":
            raise ValueError(f"groups must be a list of rank lists, an int or 'host', "
                             f"got {groups!r}")
        return groups
    if isinstance(groups, (int, np.integer)) and not isinstance(groups, bool):
        if not 1 <= groups <= size:
            raise ValueError(f"groups must be between 1 and {size} (the world size), "
                             f"got {groups}")
        return [b.tolist() for b in np.array_split(np.arange(size), int(groups))]
    try:
        out = [list(g) for g in groups]
    except TypeError:
        raise ValueError(f"groups must be a list of rank lists, an int or 'host', "
                         f"got {groups!r}") from None
    flat = [r for g in out for r in g]
    if (not out or any(not g for g in out)
            or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in flat)):
        raise ValueError(f"groups must be non-empty lists of int ranks, got {groups!r}")
    if sorted(int(r) for r in flat) != list(range(size)):
        raise ValueError(f"groups must partition the ranks 0..{size - 1} (each rank in "
                         f"exactly one group), got {groups!r}")
    return [[int(r) for r in g] for g in out]


def check_threshold(threshold: Any) -> float:
    """``threshold`` as a float ``>= 0`` (``inf`` allowed); raises ``ValueError`` naming it."""
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}") from None
    if isinstance(threshold, bool) or math.isnan(t) or t < 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    return t


def decide(table: np.ndarray, threshold: float,
           current: bool) -> tuple[bool, float | None, float | None] | None:
    """The switch rule on the allgathered ``table`` (one row per rank, columns
    :data:`TIME`, :data:`HAS`, :data:`FINISHING`, :data:`DUE`).

    Returns None when no decision is taken (no rank's interval has elapsed, or a rank is
    finishing: the mode is frozen from then on), else ``(hierarchical, zeta, v)``: ``zeta`` the
    spread of the mean processing times and ``v`` their mean (None, and the mode kept, with
    fewer than two measured ranks). ``threshold == 0`` means always hierarchical.
    """
    if table[:, FINISHING].any() or not table[:, DUE].any():
        return None
    t = table[table[:, HAS] > 0, TIME]
    if len(t) < 2:
        return current, None, None
    zeta, v = float(t.max() - t.min()), float(t.mean())
    return (threshold == 0 or zeta > threshold * v), zeta, v


async def host_groups(comm: Communicator, timeout: float | None) -> list[list[int]]:
    """The ranks of ``comm`` grouped by host (collective: one allgather), in rank order."""
    from ..comm.shm import host_hash

    got = (await comm.allgather(np.array([host_hash()], np.int64), timeout))[:, 0].tolist()
    by: dict[int, list[int]] = {}
    for r, h in enumerate(got):
        by.setdefault(h, []).append(r)
    return sorted(by.values())


class Hierarchy:
    """One rank's part of the hierarchical mode (module doc): its group's communicator and
    RNA optimizer, the correction channel and, on a leader, the exchange.

    Build it with :meth:`build` (collective over ``comm``). ``params`` is the optimizer's flat
    parameter array, updated in place. Costs per exchange: on a leader one ``solo`` execution
    among the leaders of ``params.size + G`` elements and one ``solo`` execution in the group
    of ``params.size``; on the others at most one execution in the group.
    """

    def __init__(self, comm: Communicator, members: list[list[int]], index: int,
                 group: Communicator, leaders: Communicator | None, opt: Any,
                 params: Any, name: str, timeout: float | None) -> None:
        self.comm = comm
        #: the groups, in ``comm``'s ranks (group i's rank j is ``members[i][j]``)
        self.members = members
        self.index = index  #: this rank's group
        self.group = group
        self.leaders = leaders
        self.opt = opt  #: the group's RNA optimizer (on ``group``, sharing ``params``)
        self.params = params
        self.timeout = timeout
        self.weight = len(members[index]) / comm.size
        self.exchanges = 0  #: exchanges this rank took part in
        n = params.size
        self._zeros = np.zeros_like(params)
        self._chan = group.partial_allreduce(Solo(), like=self._zeros, accumulate=Accumulate.SUM,
                                             name=f"{name}/corrections",
                                             timeout=timeout)
        self._xh = None
        if leaders is not None:
            self._buf = np.zeros_like(params, shape=(n + leaders.size,))
            self._xh = leaders.partial_allreduce(Solo(), like=self._buf,
                                                 accumulate=Accumulate.SUM,
                                                 name=f"{name}/exchange", timeout=timeout)
            self._ref = params.copy()
            #: this leader's pushes not yet seen in a result, oldest first
            self._mine: deque[Any] = deque()

    @classmethod
    async def build(cls, comm: Communicator, groups: list[list[int]] | str,
                    make_opt: Callable[[Communicator], Any], params: Any, name: str,
                    timeout: float | None) -> Hierarchy:
        """Collective over ``comm``: resolve ``"host"`` (one allgather), make the group (one
        ``split``) and the leaders' communicator (one ``split``), and the group's optimizer
        ``make_opt(group)``."""
        members = await host_groups(comm, timeout) if groups == "host" else groups
        assert not isinstance(members, str)
        index = next(i for i, m in enumerate(members) if comm.rank in m)
        group = await comm.split(index, key=members[index].index(comm.rank), timeout=timeout)
        lead = await comm.split(0 if members[index][0] == comm.rank else None, key=index,
                                timeout=timeout)
        assert group is not None
        return cls(comm, members, index, group, lead, make_opt(group), params, name, timeout)

    @property
    def leader(self) -> bool:
        """Whether this rank is its group's leader."""
        return self.leaders is not None

    def start(self) -> None:
        """Enter the hierarchical mode from the current parameters (no collective: the channel
        and the exchange are empty, see :meth:`drain`)."""
        if self.leaders is not None:
            self._ref[...] = self.params
            self._mine.clear()

    def job_ranks(self, ranks: frozenset[int]) -> frozenset[int]:
        """Group ranks as ranks of ``comm``."""
        m = self.members[self.index]
        return frozenset(m[r] for r in ranks)

    def _push(self) -> tuple[Any, Any]:
        """Fill the exchange buffer with this leader's weighted progress; returns (buffer,
        delta) and moves ``ref`` to the parameters."""
        assert self.leaders is not None
        n = self.params.size
        delta = self.params - self._ref
        wd = delta * self.weight
        self._buf[:n] = wd
        self._buf[n:] = 0
        self._buf[n + self.leaders.rank] = 1
        self._mine.append(wd)
        self._ref[...] = self.params
        return self._buf, delta

    def _others(self, value: Any) -> Any:
        """An exchange result without this leader's own pushes (the counter slot says how
        many of them it holds: they come back in the order they went)."""
        assert self.leaders is not None
        n = self.params.size
        out = value[:n].copy()
        for _ in range(round(float(value[n + self.leaders.rank]))):
            out -= self._mine.popleft()
        return out

    def _apply(self, value: Any) -> None:
        self.params += value
        if self.leaders is not None:
            self._ref += value

    async def exchange(self) -> None:
        """One exchange (module doc): a leader pushes and hands the correction to its group;
        every member applies what the channel has for it."""
        if self._xh is not None:
            buf, delta = self._push()
            res = await self._xh(buf, self.timeout)
            corr = self._others(res.value) - (1 - self.weight) * delta
            got = await self._chan(corr, self.timeout)
        else:
            got = await self._chan(self._zeros, self.timeout)
        self._apply(got.value)
        self.exchanges += 1

    async def deliver(self) -> None:
        """Collective over the group: flush the correction channel, so every member has
        applied every correction handed to it so far."""
        self._apply((await self._chan.flush(self.timeout)).value)

    async def drain(self) -> None:
        """Collective over ``comm`` (every rank, each group's RNA already finished): push what
        is left, flush the exchange and the channel. Afterwards every push has reached every
        group and every replica holds ``x0 + sum of w_g * delta`` (to rounding); the exchange and
        the channel are empty."""
        if self._xh is not None:
            buf, delta = self._push()
            res = await self._xh(buf, self.timeout)
            corr = self._others(res.value) - (1 - self.weight) * delta
            corr += self._others((await self._xh.flush(self.timeout)).value)
            self._mine.clear()  # all came back (the counters said so); nothing is pending
            self._apply((await self._chan(corr, self.timeout)).value)
        await self.deliver()
