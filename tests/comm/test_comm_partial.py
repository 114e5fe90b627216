"""Partial allreduce semantics over inproc with controlled arrival orders.

Each rank contributes a distinct known value (10**rank, times the call number where calls are
repeated), so a result's value says exactly whose data is in it. The engine runs inline on the
test's loop, so arrival orders are decided by the test (tasks and awaits), not by a thread.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from asynccoll import (
    Accumulate,
    DataPath,
    PartialAllreduce,
    PartialResult,
    Solo,
    TransportClosedError,
)
from asynccoll.collectives.partial import SNAPSHOTS, initiators
from asynccoll.testing import local_world, policy_of

KINDS = [("solo", None), ("majority", None), ("two_choice", None), ("quorum", 3)]


def v(rank: int, scale: int = 1) -> np.ndarray:
    return np.array([10.0 ** rank * scale, -(10.0 ** rank) * scale])


def total(ranks: Sequence[int]) -> np.ndarray:
    return sum((v(r) for r in ranks), np.zeros(2))


async def settle() -> None:
    """Let the in-process world run until nothing more happens (messages are immediate)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def gather(*aws: Any) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws), 10.0)


def handles(comms: Sequence[Any], kind: str, quorum: int | None = None,
            **kw: Any) -> list[PartialAllreduce]:
    return [c.partial_allreduce(policy_of(kind, quorum), like=v(0), **kw) for c in comms]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
async def test_no_stragglers_equals_full_allreduce(kind: str, quorum: int | None) -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        hs = handles(comms, kind, quorum)
        for rnd in range(3):
            rs = await gather(*(h(v(r)) for r, h in enumerate(hs)))
            full = await gather(*(c.allreduce(v(r)) for r, c in enumerate(comms)))
            for res, ref in zip(rs, full, strict=True):
                assert isinstance(res, PartialResult)
                assert np.array_equal(res.value, ref)
                assert (res.round, res.included, res.missed) == (rnd, True, 0)
                assert res.contributors == frozenset(range(P)) == res.fresh
                assert res.count == P


@pytest.mark.timeout(30)
async def test_solo_exact_sequence() -> None:
    P = 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "solo")
        r0 = await gather(h[0](v(0)))
        # rank 0 alone: the others were activated from outside and contributed nothing
        assert np.array_equal(r0[0].value, v(0))
        assert (r0[0].round, r0[0].included, r0[0].contributors) == (0, True, frozenset({0}))
        assert h[1].completed == h[2].completed == 0
        # ranks 1, 2 call after execution 0 completed: at once, included=False
        for r in (1, 2):
            (res,) = await gather(h[r](v(r)))
            assert np.array_equal(res.value, v(0))
            assert (res.round, res.included, res.missed) == (0, False, 1)
        # rank 0 again: execution 1 holds its fresh data and the others' stale data
        (res,) = await gather(h[0](v(0)))
        assert np.array_equal(res.value, total([0, 1, 2]))
        assert (res.round, res.included) == (1, True)
        assert res.contributors == frozenset({0, 1, 2})
        assert res.fresh == frozenset({0})
        assert res.count == 3
        (res1,) = await gather(h[1](v(1)))
        assert np.array_equal(res1.value, total([0, 1, 2]))
        assert (res1.round, res1.included, res1.missed) == (1, False, 1)
        # rank 1's second value is stale now; rank 2 is one round behind; flush drains all
        fl = await gather(*(x.flush() for x in h))
        for r, res in enumerate(fl):
            assert res.included
            assert res.round == 2
            assert np.array_equal(res.value, v(1)), r
            assert res.contributors == frozenset({1})


@pytest.mark.timeout(30)
async def test_majority_waits_for_its_initiator() -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "majority")
        assert len({x.seed for x in h}) == 1
        (i,) = initiators("majority", 0, P, h[0].seed)
        others = [r for r in range(P) if r != i]
        waiting = [asyncio.ensure_future(h[r](v(r))) for r in others]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiting)  # nobody but the initiator may start it
        (ri,) = await gather(h[i](v(i)))
        rs = [ri, *await gather(*waiting)]
        for res in rs:
            assert np.array_equal(res.value, total(range(P)))
            assert res.included
            assert res.round == 0
            assert res.fresh == frozenset(range(P))
        # execution 1: only its initiator calls; the others follow once it completed
        (j,) = initiators("majority", 1, P, h[0].seed)
        (rj,) = await gather(h[j](v(j, 2)))
        assert np.array_equal(rj.value, v(j, 2))
        assert rj.contributors == frozenset({j})
        for r in range(P):
            if r != j:
                (res,) = await gather(h[r](v(r, 2)))
                assert (res.round, res.included, res.missed) == (1, False, 1)
                assert np.array_equal(res.value, v(j, 2))


@pytest.mark.timeout(30)
async def test_two_choice_first_of_two_starts() -> None:
    P = 5
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "two_choice")
        a, b = sorted(initiators("two_choice", 0, P, h[0].seed))
        c = next(r for r in range(P) if r not in (a, b))
        tc = asyncio.ensure_future(h[c](v(c)))
        await asyncio.sleep(0.05)
        assert not tc.done()
        (rb,) = await gather(h[b](v(b)))
        (rc,) = await gather(tc)
        for res in (rb, rc):
            assert np.array_equal(res.value, total([b, c]))
            assert res.included
            assert res.fresh == frozenset({b, c})
        (ra,) = await gather(h[a](v(a)))
        assert (ra.included, ra.round) == (False, 0)
        assert np.array_equal(ra.value, total([b, c]))


@pytest.mark.timeout(30)
async def test_quorum_starts_at_k_arrivals() -> None:
    P, k = 4, 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "quorum", k)
        early = [asyncio.ensure_future(h[r](v(r))) for r in (0, 1)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in early)
        (r2,) = await gather(h[2](v(2)))
        rs = [*await gather(*early), r2]
        for res in rs:
            assert np.array_equal(res.value, total([0, 1, 2]))
            assert res.included
            assert res.fresh == frozenset({0, 1, 2})
        (r3,) = await gather(h[3](v(3)))
        assert (r3.included, r3.round, r3.missed) == (False, 0, 1)
        fl = await gather(*(x.flush() for x in h))
        assert all(np.array_equal(res.value, v(3)) for res in fl)


@pytest.mark.timeout(30)
async def test_activated_from_outside_before_the_call() -> None:
    # P=4, recursive doubling: rank 3 is activated through rank 2 at once, but its exchange
    # with rank 1 is slow, so its execution is under way when it calls: included=False.
    P = 4
    async with local_world(P, progress="inline", link_delay={(1, 3): 0.3}) as comms:
        h = handles(comms, "solo", path=DataPath(algorithm="recursive_doubling"))
        t0 = asyncio.ensure_future(h[0](v(0)))
        await asyncio.sleep(0.05)
        assert h[3]._state[SNAPSHOTS] == 1
        assert h[3].completed == -1
        (r3,) = await gather(h[3](v(3)))
        assert (r3.round, r3.included, r3.missed) == (0, False, 0)
        assert np.array_equal(r3.value, v(0))
        assert r3.contributors == frozenset({0})
        (r0,) = await gather(t0)
        assert np.array_equal(r0.value, v(0))
        # rank 3's data went into the next execution, exactly once
        (r0,) = await gather(h[0](v(0)))
        assert np.array_equal(r0.value, total([0, 3]))
        fl = await gather(*(x.flush() for x in h))
        assert all(float(np.abs(res.value).sum()) == 0.0 for res in fl[1:3])


async def run_random(kind: str, quorum: int | None, P: int, T: int, *, accumulate: bool,
                     seed: int, progress: str = "inline",
                     ) -> tuple[list[list[PartialResult]], list[PartialResult], list[int]]:
    """Every rank makes T calls with random pauses, then flushes; returns what each got."""
    rng = random.Random(seed)
    pauses = [[rng.uniform(0, 0.004) for _ in range(T)] for _ in range(P)]
    async with local_world(P, progress=progress) as comms:
        hs = [c.partial_allreduce(policy_of(kind, quorum), like=np.zeros(2, np.int64),
                                  accumulate=Accumulate.SUM if accumulate else Accumulate.LATEST)
              for c in comms]

        async def rank_main(r: int) -> tuple[list[PartialResult], PartialResult]:
            got = []
            for t in range(T):
                await asyncio.sleep(pauses[r][t])
                got.append(await hs[r](np.array([10**r * (t + 1), 1], np.int64), timeout=10))
            return got, await hs[r].flush(timeout=10)

        out = await asyncio.wait_for(asyncio.gather(*(rank_main(r) for r in range(P))), 60)
        seeds = [h.seed for h in hs]
    return [o[0] for o in out], [o[1] for o in out], seeds


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
async def test_conservation_every_contribution_counted_once(kind: str,
                                                            quorum: int | None) -> None:
    P, T = 5, 10
    contributed = sum(10**r * (t + 1) for r in range(P) for t in range(T))
    for seed in range(2):
        calls, flushes, _ = await run_random(kind, quorum, P, T, accumulate=True, seed=seed)
        for r in range(P):
            got = [*calls[r], flushes[r]]
            assert sum(int(g.value[0]) for g in got) == contributed, (kind, seed, r)
            assert sum(int(g.value[1]) for g in got) == P * T
            assert sum(g.count for g in got) == P * T
            rounds = [g.round for g in got]
            assert rounds == sorted(rounds)
        # after the flush every rank has seen the same last round
        assert len({f.round for f in flushes}) == 1


@pytest.mark.timeout(60)
async def test_conservation_with_progress_thread() -> None:
    P, T = 4, 8
    contributed = sum(10**r * (t + 1) for r in range(P) for t in range(T))
    calls, flushes, _ = await run_random("solo", None, P, T, accumulate=True, seed=3,
                                         progress="thread")
    for r in range(P):
        assert sum(int(g.value[0]) for g in [*calls[r], flushes[r]]) == contributed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "quorum"), [("majority", None), ("two_choice", None),
                                         ("quorum", 2), ("quorum", 4)])
async def test_every_rank_sees_the_same_rounds(kind: str, quorum: int | None) -> None:
    P, T = 5, 10
    calls, _, seeds = await run_random(kind, quorum, P, T, accumulate=False, seed=11)
    assert len(set(seeds)) == 1
    by_round: dict[int, tuple[tuple[int, ...], frozenset[int], frozenset[int]]] = {}
    for r in range(P):
        for g in calls[r]:
            key = (tuple(g.value.tolist()), g.contributors, g.fresh)
            assert by_round.setdefault(g.round, key) == key, (r, g.round)
            if g.flushed:
                continue  # forced by a flush: no initiator set, no quorum
            if kind in ("majority", "two_choice"):
                # whoever started the round was a drawn initiator with fresh data
                assert g.fresh & initiators(kind, g.round, P, seeds[0])
            if kind == "quorum":
                assert quorum is not None
                assert len(g.fresh) >= quorum
            if g.included:
                assert r in g.fresh


async def skewed_nap(kind: str, P: int, iters: int, quorum: int | None = None) -> float:
    """Mean number of active (fresh) processes per execution under linear skew."""
    async with local_world(P, progress="inline") as comms:
        hs = [c.partial_allreduce(policy_of(kind, quorum), like=np.zeros(1)) for c in comms]
        naps: dict[int, int] = {}

        async def rank_main(r: int) -> None:
            for _ in range(iters):
                await asyncio.sleep(r * 0.002)
                res = await hs[r](np.ones(1), timeout=10)
                naps[res.round] = len(res.fresh)
                await comms[r].barrier(timeout=10)

        await asyncio.wait_for(asyncio.gather(*(rank_main(r) for r in range(P))), 60)
    return float(np.mean(list(naps.values())))


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(90)
async def test_linear_skew_active_processes() -> None:
    P, iters = 8, 24
    solo = await skewed_nap("solo", P, iters)
    majority = await skewed_nap("majority", P, iters)
    quorum = await skewed_nap("quorum", P, 12, quorum=P // 2)
    assert solo <= 1.5, solo
    assert abs(majority - (P + 1) / 2) <= 1.5, majority  # uniform initiator: E = (P+1)/2
    assert P // 2 <= quorum <= P // 2 + 1.5, quorum


@pytest.mark.timeout(30)
async def test_busy_rank_is_activated_by_the_progress_thread() -> None:
    P = 3
    async with local_world(P, progress="thread") as comms:
        h = [c.partial_allreduce(Solo(), like=v(0)) for c in comms]
        await h[0](v(0))
        stale = await h[2](v(2))  # execution 0 is over: rank 2's data waits in its buffer
        assert not stale.included
        t0 = asyncio.ensure_future(h[0](v(0)))
        await asyncio.sleep(0.01)  # the call reaches the progress thread
        a = np.random.default_rng(0).random((300, 300))
        t_end = asyncio.get_running_loop().time() + 0.2
        while asyncio.get_running_loop().time() < t_end:
            a = a @ a  # this loop (rank 2's "application") is busy and never yields
            a /= np.abs(a).max()
        done_while_busy = h[2].completed
        res = await asyncio.wait_for(t0, 10)
        assert done_while_busy == 1  # rank 2 was activated from outside and contributed
        assert np.array_equal(res.value, total([0, 2]))
        assert res.contributors == frozenset({0, 2})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "quorum"), [("quorum", 3), ("majority", None)])
async def test_flush_while_a_rank_still_calls(kind: str, quorum: int | None) -> None:
    # Ranks 0 and 1 are done and flush; rank 2 still makes calls. A full quorum (or the drawn
    # initiator) can never come: rank 2's calls must still complete, and the flush must wait
    # for rank 2's flush and then drain everything.
    P = 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, kind, quorum, accumulate=Accumulate.SUM)
        first = await gather(*(x(v(r)) for r, x in enumerate(h)))
        flushing = [asyncio.ensure_future(h[r].flush(timeout=10)) for r in (0, 1)]
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in flushing)  # rank 2 has not flushed yet
        late = [await asyncio.wait_for(h[2](v(2, 10)), 5) for _ in range(3)]
        assert not any(f.done() for f in flushing)
        last = await asyncio.wait_for(h[2].flush(), 5)
        fl = await gather(*flushing)
        got0 = sum(r.value for r in (first[0], fl[0]))
        got2 = sum(r.value for r in (first[2], *late, last))
        expect = total(range(P)) + 3 * v(2, 10)
        assert np.array_equal(got0, expect)
        assert np.array_equal(got2, expect)
        assert all(r.flushed for r in (*late, last, *fl))
        assert len({r.round for r in (*fl, last)}) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("dtype", "op"), [("float32", "sum"), ("int16", "sum"),
                                           ("float64", "max"), ("int64", "min"),
                                           ("complex64", "sum"), ("float16", "prod")])
async def test_dtypes_and_ops_packed_or_not(dtype: str, op: str) -> None:
    P = 3
    rng = np.random.default_rng(1)
    xs = [rng.integers(1, 4, (2, 3)).astype(dtype) for _ in range(P)]
    async with local_world(P, progress="inline") as comms:
        hs = [c.partial_allreduce(Solo(), like=xs[0], op=op) for c in comms]
        rs = await gather(*(h(x) for h, x in zip(hs, xs, strict=True)))
        ref = await gather(*(c.allreduce(x, op=op) for c, x in zip(comms, xs, strict=True)))
        for res in rs:
            assert res.value.dtype == np.dtype(dtype)
            assert res.value.shape == (2, 3)
            assert np.array_equal(res.value, ref[0])
            assert res.contributors == frozenset(range(P))
            assert res.count == P
        # a lone contributor: the others' empty buffers hold op's identity, not zeros
        (r0,) = await gather(hs[0](xs[0]))
        assert np.array_equal(r0.value, xs[0])
        await gather(*(h.flush() for h in hs))


@pytest.mark.timeout(30)
async def test_close_stops_one_handle_and_a_waiting_call() -> None:
    async with local_world(2) as comms:
        hs = handles(comms, "majority", name="closing")
        (i,) = initiators("majority", 0, 2, hs[0].seed)
        waiting = asyncio.ensure_future(hs[1 - i](v(1 - i)))  # waits for its initiator
        await asyncio.sleep(0.05)
        await hs[1 - i].close()
        await hs[1 - i].close()  # idempotent
        with pytest.raises(TransportClosedError):
            await gather(waiting)
        with pytest.raises(TransportClosedError, match="closing"):
            await hs[1 - i](v(1 - i))
        assert "PartialAllreduce('majority', name='closing', shape=(2,)" in repr(hs[i])
        full = await gather(*(c.allreduce(v(r)) for r, c in enumerate(comms)))
        assert np.array_equal(full[0], total([0, 1]))  # the communicator goes on


@pytest.mark.timeout(30)
async def test_accumulate_mean_averages_each_execution_and_checks_its_arguments() -> None:
    async with local_world(2, progress="inline") as comms:
        for bad, match in (("bogus", "accumulate must be"), ("mean", "floating-point")):
            with pytest.raises(ValueError, match=match):
                comms[0].partial_allreduce("solo", like=np.zeros(2, np.int32), accumulate=bad)
        hs = [c.partial_allreduce(Solo(), like=np.zeros(2), accumulate=Accumulate.MEAN, name="m")
              for c in comms]
        r0 = await asyncio.gather(hs[0](np.full(2, 1.0)), hs[1](np.full(2, 2.0)))
        assert [r.count for r in r0] == [2, 2]
        np.testing.assert_allclose(r0[0].value, 1.5)  # one execution: its sum / its count
        await hs[0](np.full(2, 4.0))                  # execution 1: rank 0 alone
        late = await hs[1](np.full(2, 16.0))          # returns execution 1 at once
        assert not late.included
        np.testing.assert_allclose(late.value, 4.0)
        await hs[0](np.full(2, 8.0))                  # execution 2: 8 + rank 1's 16, count 2
        await hs[0](np.full(2, 32.0))                 # execution 3: rank 0 alone
        r = await hs[1](np.zeros(2))                  # gets executions 2 and 3 at once
        assert r.missed == 2
        assert r.count == 3
        # (8 + 16)/2 + 32/1 = 44, where sum/count would give 56/3
        np.testing.assert_allclose(r.value, 44.0)


@pytest.mark.timeout(30)
async def test_accumulate_world_divides_each_execution_by_the_world_and_checks_arguments() -> None:
    async with local_world(2, progress="inline") as comms:
        for kw, match in (({"accumulate": "world", "like": np.zeros(2, np.int32)},
                           "floating-point"),
                          ({"accumulate": "world", "like": np.zeros(2), "op": "max"},
                           "floating-point"),
                          ({"accumulate": "world", "like": np.zeros(2), "op": "avg"},
                           "give one of them")):
            with pytest.raises(ValueError, match=match):
                comms[0].partial_allreduce("solo", **kw)
        hs = [c.partial_allreduce(Solo(), like=np.zeros(2), accumulate=Accumulate.WORLD, name="w")
              for c in comms]
        r0 = await asyncio.gather(hs[0](np.full(2, 1.0)), hs[1](np.full(2, 2.0)))
        np.testing.assert_allclose(r0[0].value, 1.5)  # (1 + 2) / P
        await hs[0](np.full(2, 4.0))                  # execution 1: rank 0 alone
        await hs[0](np.full(2, 8.0))                  # execution 2: rank 0 alone
        late = await hs[1](np.full(2, 16.0))          # executions 1 and 2 at once
        assert not late.included
        assert (late.missed, late.count) == (2, 2)
        np.testing.assert_allclose(late.value, (4.0 + 8.0) / 2)  # each by P, not by count
        r = await hs[0](np.full(2, 32.0))             # execution 3: 32 + rank 1's 16
        np.testing.assert_allclose(r.value, (32.0 + 16.0) / 2)


@pytest.mark.alone
@pytest.mark.timeout(120)
async def test_float32_at_p256_one_allreduce_exact_and_disagreement_found() -> None:
    # from P = 256 float32 data carries the meta vector (its signature a byte per slot, so
    # that 256 signatures sum exactly in float32): one allreduce per execution, the sums
    # exact, and ranks that disagree on the handle still told so
    from asynccoll import ExecutionError
    from asynccoll.collectives.partial import packs_meta

    P = 256
    like = np.zeros(3, np.float32)
    assert packs_meta(like.dtype, "sum", P)
    async with local_world(P, progress="inline") as comms:
        for kind in ("solo", "majority"):
            hs = [c.partial_allreduce(kind, like=like, name=f"p256-{kind}") for c in comms]
            assert not any(s.startswith("meta_") for s in hs[0].schedule.slots)
            rs = await asyncio.wait_for(asyncio.gather(
                *(h(np.full(3, r + 1, np.float32)) for r, h in enumerate(hs))), 60)
            for res in rs:
                assert res.value.tolist() == [P * (P + 1) / 2] * 3  # 32896: exact
                assert res.contributors == frozenset(range(P)) == res.fresh
                assert res.count == P
        # rank 0 names the algorithm the others get by default: the same schedule, another
        # signature
        hs = [c.partial_allreduce(Solo(), like=like, name="p256-disagree",
                                  path=DataPath(algorithm="recursive_doubling" if r == 0 else None))
              for r, c in enumerate(comms)]
        out = await asyncio.wait_for(asyncio.gather(
            *(h(np.ones(3, np.float32)) for h in hs), return_exceptions=True), 60)
        assert all(isinstance(o, ExecutionError) for o in out), out[:3]
        assert "disagree" in str(out[0])
