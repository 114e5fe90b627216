"""One arrival script, two worlds: the inproc runtime and the simulator, call by call."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np

from asynccoll import (
    Deadline,
    Majority,
    PartialResult,
    Policy,
    Quorum,
    Solo,
    TwoChoice,
)
from asynccoll.sim import LinkClass, Profile, SimPartial, SimWorld
from asynccoll.testing import local_world

#: a profile whose costs are tiny next to the script's spacing of calls (one per second), so
#: every call's consequences settle before the next call, as the runtime's settle() does
FAST = Profile("test", LinkClass(1e-6, 1e-12), LinkClass(1e-6, 1e-12), gamma=1e-7,
               reduce_bps=1e12)


#: the deadline both worlds use in scripts: longer than any script, so the wall-clock timer of
#: the runtime and the virtual one of the simulator never fire (tests/sim/test_deadline.py
#: tests the timer in virtual time)
FIXED = (60.0, 60.0)


def value(rank: int, j: int) -> np.ndarray:
    """Rank ``rank``'s ``j``-th call's data: whose data and which call is read off the sum."""
    return np.array([10.0 ** rank * (j + 1), -(10.0 ** rank)])


async def settle() -> None:
    for _ in range(100):
        await asyncio.sleep(0)


def fields(res: PartialResult) -> tuple[Any, ...]:
    """What must agree between the runtime and the simulator (arrivals are wall-clock)."""
    return (res.round, res.included, sorted(res.contributors), res.count, res.missed,
            sorted(res.fresh), res.flushed, res.deadline, res.deadline_expired,
            None if res.value is None else res.value.tolist())


def policy(kind: str, quorum: int | None, seed: int) -> Policy:
    """The policy of ``kind``, ``quorum`` and ``seed`` that both worlds run."""
    if kind == "quorum":
        assert quorum is not None
        return Quorum(quorum)
    return {"solo": Solo(), "majority": Majority(seed=seed), "two_choice": TwoChoice(seed=seed),
            "deadline": Deadline(quorum=quorum, bounds=FIXED)}[kind]


async def run_runtime(P: int, kind: str, quorum: int | None, calls: int, seed: int,
                      script_seed: int) -> tuple[list[int], list[list[Any]], list[Any]]:
    """Drive the runtime with a random arrival order; return the order, each rank's results
    (call order) and the flushes' results."""
    rng = random.Random(script_seed)
    order: list[int] = []
    out: list[list[Any]] = [[] for _ in range(P)]
    async with local_world(P, progress="inline", timeout=20) as comms:
        hs = [c.partial_allreduce(policy(kind, quorum, seed), like=value(0, 0), name="script")
              for c in comms]
        tasks: list[asyncio.Task[PartialResult] | None] = [None] * P
        made = [0] * P
        for _ in range(40 * P):
            free = [r for r in range(P) if tasks[r] is None or tasks[r].done()]
            for r in free:
                t = tasks[r]
                if t is not None:
                    out[r].append(fields(t.result()))
                    tasks[r] = None
            if not [r for r in range(P) if tasks[r] is not None] and min(made) >= calls:
                break
            pick = [r for r in free if made[r] < calls] or free
            if not pick:
                await settle()
                continue
            r = rng.choice(pick)
            order.append(r)
            tasks[r] = asyncio.ensure_future(hs[r](value(r, made[r])))
            made[r] += 1
            await settle()
        else:
            raise AssertionError("the script did not finish")
        flushes = await asyncio.wait_for(asyncio.gather(*(h.flush() for h in hs)), 20)
    return order, out, [fields(f) for f in flushes]


def run_sim(P: int, kind: str, quorum: int | None, order: list[int], seed: int,
            data: bool = True) -> tuple[list[list[Any]], list[Any]]:
    """Replay ``order`` in the simulator, one call per virtual second; then every rank
    flushes."""
    w = SimWorld(P, FAST)
    h = SimPartial(w, policy(kind, quorum, seed), value(0, 0), data=data)
    out: list[list[Any]] = [[] for _ in range(P)]
    flushes: list[Any] = [None] * P
    made = [0] * P

    def ret(res: PartialResult, r: int) -> None:
        out[r].append(fields(res))

    def fl(res: PartialResult, r: int) -> None:
        flushes[r] = fields(res)

    for i, r in enumerate(order):
        j = made[r]
        made[r] += 1
        w.at(float(i + 1), h.call, r, value(r, j), ret)
    for r in range(P):
        w.at(float(len(order) + 2), h.flush, r, fl)
    w.run()
    return out, flushes
