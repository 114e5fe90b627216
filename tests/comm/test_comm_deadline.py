"""``comm.partial_allreduce("deadline", ...)``: k arrivals or an adaptive deadline after the
first arrival, whichever comes first; every rank agrees on how each execution started and on
the deadline it used. In-process worlds, and real processes over tcp."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import (
    Accumulate,
    Deadline,
    ExecutionError,
    PartialResult,
    Quorum,
    Solo,
    SparseVector,
)
from asynccoll.collectives.sparse import to_dense
from asynccoll.testing import local_world

pytestmark = pytest.mark.alone  # timing-sensitive: runs after the parallel part (Makefile)


def v(rank: int, step: int = 0) -> np.ndarray:
    return np.arange(4, dtype=np.float64) + 10.0 * rank + 1000.0 * step


async def call(h: Any, x: Any, delay: float = 0.0,
               timeout: float = 10.0) -> tuple[PartialResult, float]:
    """Sleep ``delay``, call, return the result and how long the call took."""
    if delay:
        await asyncio.sleep(delay)
    t = time.monotonic()
    res = await h(x, timeout)
    return res, time.monotonic() - t


def handles(comms: Sequence[Any], policy: Deadline, **kw: Any) -> list[Any]:
    return [c.partial_allreduce(policy, like=v(0), name="dl", **kw) for c in comms]


@pytest.mark.timeout(30)
async def test_never_starts_before_k_arrivals_or_the_deadline() -> None:
    P, k = 4, 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, Deadline(quorum=k, bounds=1.0))
        early = [asyncio.ensure_future(call(h[r], v(r))) for r in (0, 1)]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in early)  # 2 < k arrivals, deadline not reached
        (r2, _), *rest = await asyncio.gather(call(h[2], v(2)), *early)
        for res, took in [(r2, 0.0), *rest]:
            assert res.included
            assert res.fresh == frozenset({0, 1, 2})
            assert res.deadline == 1.0
            assert res.deadline_expired is False
            assert took < 0.9  # started by the k-th arrival, not the deadline
            np.testing.assert_array_equal(res.value, v(0) + v(1) + v(2))
        (r3, _), = await asyncio.gather(call(h[3], v(3)))
        assert (r3.round, r3.included) == (0, False)
        fl = await asyncio.gather(*(x.flush() for x in h))
        assert all(np.array_equal(f.value, v(3)) for f in fl)


@pytest.mark.timeout(30)
async def test_starts_at_the_deadline_when_fewer_arrived() -> None:
    P = 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, Deadline(bounds=0.15))  # quorum: all P
        out = await asyncio.gather(call(h[0], v(0)), call(h[1], v(1), 0.01),
                                   call(h[2], v(2), 0.6))
        for r in (0, 1):
            res, took = out[r]
            assert res.deadline_expired is True
            assert res.deadline == 0.15
            assert res.fresh == frozenset({0, 1})
            np.testing.assert_array_equal(res.value, v(0) + v(1))
        # the first arrival waited the deadline, not for rank 2
        assert 0.14 <= out[0][1] < 0.5
        late, took = out[2]
        assert (late.round, late.included, late.deadline_expired) == (0, False, True)
        assert took < 0.1  # rule 1: answered at once
        fl = await asyncio.gather(*(x.flush() for x in h))
        assert all(np.array_equal(f.value, v(2)) for f in fl)
        assert all(f.deadline_expired is False for f in fl)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("progress", ["inline", "thread"])
async def test_adapts_down_when_arrivals_tighten_and_up_when_they_spread(progress: str) -> None:
    """Steps aligned by a barrier; rank 2 is 0.25 s late in the middle phase. The deadline
    falls from hi to lo while arrivals are tight, grows to about the spread once rank 2 is
    late (its late calls are reported), and falls again; every rank reports the same
    deadline and start for every round, and with ``Accumulate.SUM`` every rank applies the
    same total, which equals the NumPy sum of every contribution."""
    P, lo, hi, gap = 3, 0.04, 0.6, 0.25
    phases = [0.0] * 5 + [gap] * 7 + [0.0] * 6
    async with local_world(P, progress=progress) as comms:
        h = handles(comms, Deadline(bounds=(lo, hi), mad_factor=3.0, window=4),
                    accumulate=Accumulate.SUM)
        barrier = asyncio.Barrier(P)
        seen: list[dict[int, tuple[float | None, bool | None]]] = [{} for _ in range(P)]
        totals = [np.zeros(4) for _ in range(P)]
        nexts: list[list[float]] = [[] for _ in range(P)]

        async def rank(r: int) -> None:
            for s, late in enumerate(phases):
                await barrier.wait()
                res, _ = await call(h[r], v(r, s), late if r == 2 else 0.0)
                totals[r] += res.value
                seen[r][res.round] = (res.deadline, res.deadline_expired)
                nexts[r].append(h[r].next_deadline)
            res = await h[r].flush(10)
            totals[r] += res.value

        await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 50)
    ref = sum(v(r, s) for r in range(P) for s in range(len(phases)))
    for r in range(P):
        np.testing.assert_array_equal(totals[r], ref)  # conservation: NumPy reference
        np.testing.assert_array_equal(totals[r], totals[0])  # replicas stay equal
        common = set(seen[r]) & set(seen[0])
        assert all(seen[r][e] == seen[0][e] for e in common)  # one deadline, one story
    d = nexts[0]
    assert d[4] == lo, d  # tight: down to lo
    assert d[11] > 0.8 * gap, d  # spread out: up to about the spread
    assert d[11] <= hi
    assert d[-1] == lo, d  # tight again
    # the middle phase's first rounds were cut by the deadline, the later ones were not
    story = seen[0]
    assert any(exp for _, exp in story.values())
    assert story[max(story)][1] is False


@pytest.mark.timeout(60)
async def test_random_arrivals_invariants_and_conservation() -> None:
    """Random delays: a round the deadline did not start has at least k fresh calls; one it
    started made its first caller wait at least the deadline; nothing lost or doubled."""
    P, k, T = 4, 3, 14
    rng = random.Random(5)
    delays = [[rng.choice([0.0, 0.0, 0.01, 0.08, 0.2]) for _ in range(T)] for _ in range(P)]
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, Deadline(quorum=k, bounds=(0.03, 0.15), window=5),
                    accumulate=Accumulate.SUM)
        got: list[list[tuple[PartialResult, float]]] = [[] for _ in range(P)]
        totals = [np.zeros(4) for _ in range(P)]

        async def rank(r: int) -> None:
            for s in range(T):
                res, took = await call(h[r], v(r, s), delays[r][s])
                got[r].append((res, took))
                totals[r] += res.value
            totals[r] += (await h[r].flush(10)).value

        await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 50)
    ref = sum(v(r, s) for r in range(P) for s in range(T))
    for r in range(P):
        np.testing.assert_array_equal(totals[r], ref)
    for r in range(P):
        for res, took in got[r]:
            assert res.deadline is not None
            assert 0.03 <= res.deadline <= 0.15
            if not res.included or res.missed or res.flushed:
                continue
            if not res.deadline_expired:
                assert len(res.fresh) >= k, res
            elif res.lateness == 0.0 and not res.flushed:  # this rank arrived first
                assert took >= res.deadline - 0.005, (took, res)


@pytest.mark.timeout(30)
async def test_sparse_contributions() -> None:
    async with local_world(2, progress="inline") as comms:
        like = SparseVector([], np.zeros(0, np.float32), 100)
        hs = [c.partial_allreduce(Deadline(bounds=0.05), like=like, accumulate=Accumulate.SUM,
                                  name="s") for c in comms]
        x0 = SparseVector([1, 5], np.array([1.0, 2.0], np.float32), 100)
        x1 = SparseVector([5, 7], np.array([3.0, 4.0], np.float32), 100)
        (a, _), (b, _) = await asyncio.gather(call(hs[0], x0), call(hs[1], x1, 0.3))
        assert (a.deadline_expired, a.fresh, b.included) == (True, frozenset({0}), False)
        np.testing.assert_array_equal(to_dense(a.value), to_dense(x0))
        f = await asyncio.gather(*(h.flush(5) for h in hs))
        for r in f:
            np.testing.assert_array_equal(to_dense(r.value), to_dense(x1))


@pytest.mark.timeout(30)
async def test_bad_arguments_name_the_argument() -> None:
    async with local_world(2, progress="inline") as comms:
        c = comms[0]
        bad: list[tuple[dict[str, Any], str]] = [
            ({"quorum": 0}, "quorum"), ({"quorum": 3}, "quorum"),
            ({"bounds": (0.5, 0.1)}, "deadline"), ({"bounds": -1.0}, "deadline"),
            ({"mad_factor": -0.5}, "mad_factor"), ({"window": 0}, "window")]
        for kw, name in bad:
            with pytest.raises(ValueError, match=name):
                c.partial_allreduce(Deadline(**kw), like=v(0))
        # (a deadline's parameters on another policy cannot be spelled any more)
        with pytest.raises(TypeError, match="mad_factor"):
            c.partial_allreduce(Quorum(2), like=v(0), mad_factor=2.0)
        with pytest.raises(TypeError, match="deadline"):
            c.partial_allreduce(Solo(), like=v(0), deadline=0.1)


@pytest.mark.timeout(30)
async def test_ranks_that_disagree_on_the_deadline_get_an_error() -> None:
    async with local_world(2, progress="inline") as comms:
        a = comms[0].partial_allreduce(Deadline(bounds=(0.01, 0.5)), like=v(0), name="x")
        b = comms[1].partial_allreduce(Deadline(bounds=(0.01, 0.4)), like=v(0), name="x")
        out = await asyncio.gather(a(v(0), 5), b(v(1), 5), return_exceptions=True)
        assert all(isinstance(o, ExecutionError) for o in out), out
        assert "deadline" in str(out[0])


async def _tcp_rank(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    async with comm:
        h = comm.partial_allreduce(Deadline(bounds=(0.03, 0.5), window=3), like=v(0),
                                   accumulate=Accumulate.SUM, name="tcp-dl")
        total = np.zeros(4)
        story: dict[int, tuple[float | None, bool | None, list[int]]] = {}
        deadlines = []
        steps = 8
        for s in range(steps):
            await comm.barrier(timeout=30)
            if rank == P - 1 and 2 <= s < 6:
                await asyncio.sleep(0.2)  # a straggler in the middle steps
            res = await h(v(rank, s), 30)
            total += res.value
            story[res.round] = (res.deadline, res.deadline_expired, sorted(res.fresh))
            deadlines.append(h.next_deadline)
        total += (await h.flush(30)).value
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.2)
    return {"total": total.tolist(), "story": story, "deadlines": deadlines}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tcp_processes_agree_and_conserve() -> None:
    P, steps = 3, 8
    out = spawn_world(async_child, P, (_tcp_rank, free_port()), 90)
    ref = sum(v(r, s) for r in range(P) for s in range(steps))
    for o in out:
        np.testing.assert_array_equal(o["total"], ref)
        common = set(o["story"]) & set(out[0]["story"])
        assert all(o["story"][e] == out[0]["story"][e] for e in common)
        assert o["deadlines"] == out[0]["deadlines"]
    story = out[0]["story"]
    d = out[0]["deadlines"]
    # tight first steps: at lo (0.03) unless a stall of 15 ms or more on this loaded machine
    # spread them (d = median + 3 MAD of two spreads), well below what the straggler makes it
    assert 0.03 <= d[1] < 0.1, d
    assert any(exp for _, exp, _ in story.values())  # the straggler was cut off at least once
    assert max(d) > 0.1  # and the deadline grew towards its lateness
