"""The hierarchical handle's regrow agrees on who was ever a member: a handle that never ran (a
restarted or new rank's) reports the same ``lost`` ranks as the members after it is taken in.

A logic test of :meth:`Regrouping._regrow` with stand-in communicators (one host, an allgather
shared by the two handles), so that the case is exact: ranks 0-3 trained, rank 3 was lost for
good, rank 2 restarts and is taken back; members and joiner must both report rank 3 lost (the
joiner reported nobody lost before, having no history of its own)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives.policy import Solo
from asynccoll.comm.hier_survival import Regrouping

pytestmark = pytest.mark.timeout(30)


class _Gather:
    """One allgather of the stand-in group: each caller's row, once all of them gave one."""

    def __init__(self, n: int) -> None:
        self.n, self.rows, self.done = n, {}, asyncio.Event()

    async def __call__(self, me: int, a: Any) -> Any:
        self.rows[me] = np.asarray(a)
        if len(self.rows) == self.n:
            self.done.set()
        await self.done.wait()
        return np.array([self.rows[r] for r in sorted(self.rows)])


class _Grown:
    def __init__(self, members: list[int], gather: _Gather, me: int) -> None:
        self.members, self.size = tuple(members), len(members)
        self.membership = NS(lost=None)
        self._gather, self._me = gather, me

    async def allgather(self, a: Any, timeout: float | None) -> Any:
        return await self._gather(self._me, a)

    async def split(self, key: Any, timeout: float | None = None) -> Any:
        return NS()

    async def group(self, ranks: Any, timeout: float | None) -> Any:
        return None


def _handle(rank: int) -> Regrouping:
    job = NS(members=tuple(range(4)), size=4, rank=rank, membership=NS(lost=None))
    job.job = job
    h = Regrouping.__new__(Regrouping)
    h.name, h.policy, h._comm, h._like = "h", Solo(), job, np.zeros(2)
    h._options, h._host, h._handle, h._hosts, h._closed = {}, None, None, [], False
    h._init_survival(True)
    return h


async def test_a_joiner_reports_the_members_lost_ranks() -> None:
    member, joiner = _handle(0), _handle(2)
    member._host, member._epoch = object(), 1  # it ran, and regrouped once (rank 3 lost)
    gather = _Gather(2)
    member.grow(_Grown([0, 1, 2], gather, 0), 10, [])
    joiner.grow(_Grown([0, 1, 2], gather, 2), 10, [])
    await asyncio.gather(member._regrow(None), joiner._regrow(None))
    assert sorted(member.lost) == sorted(joiner.lost) == [3]
    assert member.world_size == joiner.world_size == 3
