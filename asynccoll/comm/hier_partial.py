"""The hierarchical partial allreduce: a host activates as a unit.

``comm.partial_allreduce(kind, like, algorithm="hier")``. Across hosts a partial collective
hides the stragglers among *hosts*; within a host the ranks share memory and a core budget, and
a call goes like the hierarchical synchronous allreduce (docs/collectives.md):

1. **within the host**, synchronously: the ranks of the host sum their data, through shared
   memory (the host group's allreduce, which takes that path from 128 KiB);
2. **among the hosts**, partially: the host's leader (its lowest rank) contributes the host's
   sum to a partial allreduce handle of ``kind`` among the leaders, over the network, with
   every rule of that kind (activation, rule 1, staleness, accumulation);
3. **within the host** again: the leader hands the result and what it says (round,
   contributors, ...) to its ranks, through shared memory as well (the value as a sum in which
   the other ranks put zeros: ``v + 0 = v`` exactly, so every rank of the host, the leader
   included, holds the same bits).

So a host whose ranks are late is a late host: the fast hosts go on without it, and its sum
goes into a later execution, as a late rank's data does in the flat handle; a straggler within
a host delays its host (that is what "a host activates as a unit" means, and why this is asked
for by name, not the default: where stragglers are single ranks, the flat handle hides them).

What results say, in the world's ranks: ``contributors`` and ``fresh`` are the ranks of the
hosts whose leader was one, ``arrivals`` gives every rank of a host its leader's arrival;
``included`` is whether this host's sum of this call is in ``value``; ``count`` counts the
leaders' contributions (host sums), and ``world_size`` is the world's size. ``quorum``
(quorum and deadline kinds) counts hosts. Not offered here, each refused by name:
``op="avg"`` and ``accumulate="mean"``/``"world"`` (their divisors count host sums, not
ranks), ``survive`` (a lost rank would leave its host's ranks waiting), ``shm`` (the host
step always takes shared memory), sparse and tensor data (NumPy arrays only). Its calls are
awaited only (no ``blocking`` twin, no ``out=``, no ``combine``).

**Setup.** The first call (or flush) of the handle on each rank makes the host groups and the
leaders' group (``comm.split("host")``, ``comm.group(leaders)``: collective over the whole
communicator, so every rank makes its first call among its other collectives in the same
order), and the leaders' partial handle.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..results import PartialResult

# The communicator and its groups are typed Any here: this module is imported by
# .communicator, and a type-only import back would make the two import each other.
Communicator = Any

__all__ = ["HierPartialAllreduce"]

# the header the leader hands to its host: these fields, then per leader its contributor
# flag, its fresh flag and its arrival (NaN: none)
_ROUND, _INCLUDED, _COUNT, _MISSED, _FLUSHED, _EXPIRED, _DEADLINE, _FIELDS = range(8)


class HierPartialAllreduce:
    """A partial allreduce of ``kind`` among hosts, synchronous within each (module doc).

    Made by :meth:`Communicator.partial_allreduce
    <asynccoll.Communicator.partial_allreduce>` with ``algorithm="hier"``; the same calls as
    :class:`~asynccoll.comm.partial.PartialAllreduce`: ``await h(x)``, ``await h.flush()``,
    ``await h.close()``.
    """

    def __init__(self, comm: Communicator, kind: str, like: np.ndarray[Any, Any], name: str,
                 options: dict[str, Any]) -> None:
        self.kind = kind
        self.name = name
        self._comm = comm
        self._like = like
        self._options = options
        self._setup_lock = asyncio.Lock()
        self._host: Communicator | None = None
        self._lead: Communicator | None = None
        self._handle: Any = None
        self._hosts: list[list[int]] = []  # the world ranks of each leader's host, in order
        self._closed = False

    @property
    def hosts(self) -> list[list[int]]:
        """The world ranks of each host, in the order of their leaders (after the first
        call)."""
        return [list(h) for h in self._hosts]

    async def _setup(self, timeout: float | None) -> Communicator:
        async with self._setup_lock:
            if self._host is None:
                comm = self._comm
                host = await comm.split("host", timeout=timeout)
                assert host is not None
                leader = int(host.members[0])  # ordered by rank: the lowest
                of = (await comm.allgather(np.array([leader], np.int64), timeout))[:, 0]
                leaders = sorted(set(of.tolist()))
                self._hosts = [[r for r in range(comm.size) if of[r] == lead]
                               for lead in leaders]
                self._lead = await comm.group(leaders, timeout)
                if self._lead is not None:
                    self._handle = self._lead.partial_allreduce(
                        self.kind, self._like, name=f"{self.name}/leaders", **self._options)
                self._host = host
            return self._host

    async def __call__(self, x: Any, timeout: float | None = None) -> PartialResult:
        """Contribute ``x`` (shape and dtype of ``like``): its host's sum goes to the leaders'
        handle; returns what that call returned, for every rank of the host (module doc).
        Raises as the flat handle's call does."""
        self._check_open()
        x = np.asarray(x)
        if x.shape != self._like.shape or x.dtype != self._like.dtype:
            raise ValueError(f"x must have like's shape {self._like.shape} and dtype "
                             f"{self._like.dtype}, got {x.shape} {x.dtype}")
        host = await self._setup(timeout)
        op = self._options.get("op", "sum")
        summed = await host.allreduce(x, op=op, timeout=timeout)
        res = None if self._handle is None else await self._handle(summed, timeout)
        return await self._hand_out(host, res, timeout)

    async def flush(self, timeout: float | None = None) -> PartialResult:
        """Collective over the world: every rank calls it after its last call; the leaders
        flush their handle (docs of :meth:`PartialAllreduce.flush
        <asynccoll.comm.partial.PartialAllreduce.flush>`) and hand its result out."""
        self._check_open()
        host = await self._setup(timeout)
        res = None if self._handle is None else await self._handle.flush(timeout)
        return await self._hand_out(host, res, timeout)

    async def close(self) -> None:
        """Stop this handle on this rank (local, as the flat handle's close). Idempotent."""
        self._closed = True
        if self._handle is not None:
            await self._handle.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"hierarchical partial allreduce {self.name!r} is closed")

    async def _hand_out(self, host: Communicator, res: PartialResult | None,
                        timeout: float | None) -> PartialResult:
        """The leader's result to every rank of its host (module doc, step 3)."""
        n = len(self._hosts)
        head = np.full(_FIELDS + 3 * n, np.nan)
        value = np.zeros_like(self._like)
        if res is not None:
            expired = res.deadline_expired
            head[:_FIELDS] = (res.round, res.included, res.count, res.missed, res.flushed,
                              -1 if expired is None else expired,
                              np.nan if res.deadline is None else res.deadline)
            head[_FIELDS:_FIELDS + n] = [i in res.contributors for i in range(n)]
            head[_FIELDS + n:_FIELDS + 2 * n] = [i in res.fresh for i in range(n)]
            for i, t in res.arrivals.items():
                head[_FIELDS + 2 * n + i] = t
            value[...] = res.value
        head = await host.broadcast(head, 0, timeout)
        value = await host.allreduce(value, timeout=timeout)
        return self._result(value, head)

    def _result(self, value: Any, head: np.ndarray[Any, Any]) -> PartialResult:
        n = len(self._hosts)

        def ranks(flags: np.ndarray[Any, Any]) -> frozenset[int]:
            return frozenset(r for i in np.flatnonzero(flags) for r in self._hosts[i])

        arrivals = {r: float(t) for i, t in enumerate(head[_FIELDS + 2 * n:])
                    if not np.isnan(t) for r in self._hosts[i]}
        expired = int(head[_EXPIRED])
        deadline = float(head[_DEADLINE])
        rank = self._comm.rank
        return PartialResult(
            value, int(head[_ROUND]), bool(head[_INCLUDED]),
            ranks(head[_FIELDS:_FIELDS + n]), int(head[_COUNT]), int(head[_MISSED]),
            ranks(head[_FIELDS + n:_FIELDS + 2 * n]), bool(head[_FLUSHED]), arrivals,
            arrivals.get(rank), max(arrivals.values()) if arrivals else None,
            None if np.isnan(deadline) else deadline, None if expired < 0 else bool(expired),
            self._comm.size)

    def __repr__(self) -> str:
        return (f"HierPartialAllreduce(kind={self.kind!r}, name={self.name!r}, "
                f"hosts={self._hosts or 'not yet known'})")
