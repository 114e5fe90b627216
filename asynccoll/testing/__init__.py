"""Helpers to test code built on asynccoll: P ranks in one process.

``inproc_world(P)`` yields P connected in-process transports; ``run_schedules`` executes one
committed schedule per rank over them and returns when every rank's execution completed.
``policy_of(kind, quorum)`` names a straggler policy for tests parametrised over the kinds.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ..collectives.policy import Deadline, Policy, Quorum, as_policy
from ..sched import Executor, Kernel, Schedule
from ..transport.inproc import InprocFabric, InprocTransport
from .conformance import check_transport
from .world import local_world

__all__ = ["check_transport", "inproc_world", "local_world", "policy_of", "run_schedules"]

_names = itertools.count()


def policy_of(kind: str, quorum: int | None = None) -> Policy:
    """The policy named ``kind`` (``"solo"``, ..., :func:`~asynccoll.as_policy`'s text) with
    the arrival ``quorum`` (``"quorum"``: ``Quorum(quorum)``, ``"deadline"``:
    ``Deadline(quorum=quorum)``; ``ValueError`` naming ``quorum`` for another kind), for tests
    parametrised over the kinds by name."""
    if quorum is None:
        return as_policy(kind)
    if kind == "quorum":
        return Quorum(quorum)
    if kind == "deadline":
        return Deadline(quorum=quorum)
    raise ValueError(f"quorum is only meaningful for 'quorum' or 'deadline', got {kind!r}")


@asynccontextmanager
async def inproc_world(world_size: int, *, delay: float = 0.0, seed: int = 0,
                       link_delay: Mapping[tuple[int, int], float] | None = None,
                       ) -> AsyncIterator[list[InprocTransport]]:
    """P connected :class:`InprocTransport` endpoints on a fresh fabric; closed on exit."""
    fabric = InprocFabric(f"world-{next(_names)}", delay=delay, seed=seed, link_delay=link_delay)
    ts = [InprocTransport(r, world_size, fabric=fabric) for r in range(world_size)]
    addrs = {r: await t.listen() for r, t in enumerate(ts)}
    for t in ts:
        await t.connect({r: a for r, a in addrs.items() if r != t.rank})
    try:
        yield ts
    finally:
        for t in ts:
            await t.close()


async def run_schedules(transports: Sequence[Any], schedules: Sequence[Schedule],
                        buffers: Sequence[Mapping[str, Any]], *, sched_id: int = 1,
                        executions: int = 1, timeout: float = 30.0,
                        kernels: Mapping[str, Kernel] | None = None) -> list[Executor]:
    """Run ``executions`` executions of each rank's schedule; return the executors.
    ``kernels``: the executors' kernel registry (default: the built-ins)."""
    exs = [Executor(s, t, b, sched_id=sched_id, kernels=kernels) for s, t, b in
           zip(schedules, transports, buffers, strict=True)]
    for _ in range(executions):
        futs = [ex.start() for ex in exs]
        await asyncio.wait_for(asyncio.gather(*futs), timeout)
    return exs
