"""A flush planned one step ahead (``h.plan_flush()``, ``h.flush_planned``, ``h.flush(x=...)``):
every rank learns the plan from a completed execution, and a flush that carries each rank's
last contribution takes one execution where a call followed by a flush takes two or three."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate
from asynccoll.testing import local_world, policy_of


def v(rank: int, step: int) -> np.ndarray:
    return np.array([10.0 ** rank * (step + 1), 1.0])


async def _steps(h: Any, rank: int, P: int, steps: int, planner: int, plan_at: int,
                 skew: float = 0.0) -> dict[str, Any]:
    """``steps`` steps of a training loop: a step is ``h.flush(x=...)`` when a flush is
    planned, a call otherwise; rank ``planner`` plans one after its step ``plan_at``; rank r
    computes ``skew * r`` seconds before each step."""
    got, count, flushes = np.zeros(2), 0, []
    for step in range(steps):
        await asyncio.sleep(skew * rank)
        x = v(rank, step)
        if h.flush_planned:
            before = h.completed
            res = await h.flush(30, x)
            flushes.append((step, h.completed - before))
            assert not h.flush_planned  # (the plan ended with the flush)
        else:
            res = await h(x, 30)
        got += res.value
        count += res.count
        if rank == planner and step == plan_at:
            h.plan_flush()
    res = await h.flush(30)
    got += res.value
    count += res.count
    return {"got": got.tolist(), "count": count, "flushes": flushes}


def _expected(P: int, steps: int) -> list[float]:
    return [sum(10.0 ** r * (s + 1) for r in range(P) for s in range(steps)), P * steps]


@pytest.mark.timeout(30)
async def test_planned_flush_inproc() -> None:
    P, steps = 3, 8
    async with local_world(P, progress="inline") as comms:
        hs = [c.partial_allreduce(policy_of("quorum", P), like=v(0, 0),
                                  accumulate=Accumulate.SUM) for c in comms]
        out = await asyncio.wait_for(asyncio.gather(
            *(_steps(h, r, P, steps, 1, 2) for r, h in enumerate(hs))), 20)
    for o in out:
        assert o["got"] == _expected(P, steps)
        assert o["count"] == P * steps
        # planned after step 2, learned from step 3's execution: step 4 flushed, in one
        assert o["flushes"] == [(4, 1)]


async def _rank(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    async with comm:
        # a quorum of every rank: each step's execution holds every rank's call, so every
        # rank learns the plan from the same execution
        h = comm.partial_allreduce(policy_of("quorum", P), like=v(0, 0),
                                   accumulate=Accumulate.SUM)
        out = await _steps(h, rank, P, 10, P - 1, 5, skew=0.03)
        await comm.barrier(timeout=30)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_planned_flush_processes() -> None:
    P = 3
    out = spawn_world(async_child, P, (_rank, free_port()), 90.0)
    for o in out:
        assert o["got"] == _expected(P, 10)
        assert o["count"] == P * 10
        # every rank flushed at step 7, in one execution: the ranks that planned wait until
        # every rank said it began its flush before forcing one, however far apart they come
        assert o["flushes"] == [(7, 1)]
