"""Rule-1 calls are answered on the caller's thread (no hop to the progress thread), and the
lock they share with the runtime keeps every contribution in exactly one execution."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import numpy as np
import pytest

from asynccoll import Accumulate, Quorum, Solo
from asynccoll.testing import local_world

N = 8


def _recording(threads: list[str]) -> Any:
    def combine(acc: Any, x: Any, n: int, late: bool) -> int:
        threads.append(threading.current_thread().name)
        acc += x
        return n + 1
    return combine


@pytest.mark.timeout(30)
async def test_a_call_that_returns_at_once_stays_on_the_callers_thread() -> None:
    async with local_world(2, "tcp", timeout=10) as comms:
        hs = [c.partial_allreduce(Solo(), like=np.zeros(N, np.float32)) for c in comms]
        # rank 0 starts execution 0 alone; rank 1's contribution is late for it
        r0 = await hs[0](np.ones(N, np.float32))
        assert r0.included
        assert r0.round == 0
        for _ in range(200):  # execution 0 reaches rank 1 from outside
            if hs[1].completed >= 0:
                break
            await asyncio.sleep(0.01)
        threads: list[str] = []
        engine_runs = 0
        real_run = hs[1]._engine.run

        async def counting_run(coro: Any) -> Any:
            nonlocal engine_runs
            engine_runs += 1
            return await real_run(coro)

        hs[1]._engine.run = counting_run  # type: ignore[method-assign]
        try:
            r1 = await hs[1](np.full(N, 2, np.float32), combine=_recording(threads))
        finally:
            del hs[1]._engine.run
        assert not r1.included
        assert r1.round == 0
        assert np.array_equal(r1.value, np.ones(N, np.float32))
        assert threads == [threading.current_thread().name]  # the caller's, not the runtime's
        assert engine_runs == 0
        # a call that must wait runs on the runtime's thread
        task = asyncio.ensure_future(hs[1](np.full(N, 3, np.float32),
                                           combine=_recording(threads)))
        await asyncio.sleep(0.05)
        assert threads[-1] == "asynccoll-progress"
        await hs[0](np.zeros(N, np.float32))  # rank 0 starts execution 1: 2 + 3 from rank 1
        r = await asyncio.wait_for(task, 10)
        assert r.round == 1
        assert np.array_equal(r.value, np.full(N, 5, np.float32))


@pytest.mark.timeout(60)
async def test_contributions_are_conserved_while_calls_race_the_runtime() -> None:
    # Callers on the test's thread, snapshots and completions on the progress thread: every
    # contribution must land in exactly one execution, whichever thread deposits it.
    P, calls = 4, 150
    rng = random.Random(7)
    async with local_world(P, "tcp", timeout=20) as comms:
        hs = [c.partial_allreduce(Solo(), like=np.zeros(N, np.float64), accumulate=Accumulate.SUM)
              for c in comms]
        got = [np.zeros(N) for _ in range(P)]
        at_once = [0] * P

        async def rank(r: int) -> None:
            for i in range(calls):
                res = await hs[r](np.full(N, r * calls + i + 1, np.float64))
                got[r] += res.value
                at_once[r] += not res.included
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.002 * (r + 1))

        await asyncio.gather(*(rank(r) for r in range(P)))
        for r, res in enumerate(await asyncio.gather(*(h.flush() for h in hs))):
            got[r] += res.value
    want = sum(range(1, P * calls + 1))
    for r in range(P):
        assert np.array_equal(got[r], np.full(N, want, np.float64)), r
    assert sum(at_once) > 0  # the fast path was taken


@pytest.mark.timeout(30)
def test_blocking_calls_answered_at_once_do_not_cross_either() -> None:
    async def body() -> tuple[Any, Any]:
        async with local_world(2, "tcp", timeout=10) as comms:
            h1 = comms[1]._shortcut("solo", np.zeros(N, np.float32))
            await comms[0].solo_allreduce(np.ones(N, np.float32))  # rank 0 alone: execution 0
            for _ in range(200):
                if h1.completed >= 0:
                    break
                await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            crossed: list[bool] = []
            real = h1._engine.run_blocking

            def counting(coro: Any) -> Any:
                crossed.append(True)
                return real(coro)

            h1._engine.run_blocking = counting  # type: ignore[method-assign]
            try:
                # from a thread without a loop, as synchronous training code calls it
                res = await loop.run_in_executor(
                    None, comms[1].blocking.solo_allreduce, np.full(N, 2, np.float32))
            finally:
                del h1._engine.run_blocking
            return res, crossed

    res, crossed = asyncio.run(body())
    assert not crossed
    assert not res.included
    assert np.array_equal(res.value, np.ones(N, np.float32))


@pytest.mark.timeout(30)
async def test_results_say_who_arrived_late_and_by_how_much() -> None:
    async with local_world(3, "tcp", timeout=10) as comms:
        hs = [c.partial_allreduce(Quorum(3), like=np.zeros(N)) for c in comms]

        async def call(r: int, delay: float) -> Any:
            await asyncio.sleep(delay)
            return await hs[r](np.ones(N))

        for _ in range(3):
            rs = await asyncio.gather(call(0, 0.0), call(1, 0.02), call(2, 0.05))
            for r, res in enumerate(rs):
                assert set(res.arrivals) == {0, 1, 2}
                assert res.arrivals[0] == 0.0
                # called 20 and 50 ms after rank 0; the bounds leave room for a stall of
                # 10 ms or more between the calls and their stamps on a loaded machine
                a1, a2 = res.arrivals[1], res.arrivals[2]
                assert 0.005 < a1 < a2 < 0.2, res.arrivals
                assert a2 - a1 > 0.01, res.arrivals
                assert res.lateness == res.arrivals[r]
                assert res.latest_arrival == res.arrivals[2]
        flushed = await asyncio.gather(*(h.flush() for h in hs))
        assert all(f.lateness is None or f.lateness >= 0 for f in flushed)
