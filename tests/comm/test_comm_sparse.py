"""``comm.sparse_allreduce`` and sparse contributions in partial collectives.

Values are integers (exact in floating point), so every result is compared bit for bit with
the dense sum. In the partial tests each rank owns two coordinates and contributes 10**rank
(times the call number where calls repeat), so a result's value says whose data is in it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import (
    Accumulate,
    CollectiveTimeoutError,
    DataPath,
    Majority,
    PartialResult,
    Solo,
    SparseVector,
    TransportClosedError,
)
from asynccoll.collectives.partial import SNAPSHOTS, initiators
from asynccoll.collectives.sparse import from_dense, to_dense
from asynccoll.collectives.sparse.schedules import ALGORITHMS
from asynccoll.testing import local_world, policy_of

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
KINDS = [("solo", None), ("majority", None), ("two_choice", None), ("quorum", 3)]


async def gather(*aws: Any) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws), 20.0)


def random_sparse(rng: np.random.Generator, n: int, density: float,
                  dtype: Any = np.float32) -> np.ndarray:
    """A dense array of small integers, nonzero with probability ``density``."""
    vals = rng.integers(-4, 5, n).astype(dtype)
    return np.where(rng.random(n) < density, vals, 0).astype(dtype)


def cases(P: int, n: int, seed: int) -> list[list[np.ndarray]]:
    """Per case, one dense array per rank: random sparse, random dense (past delta), empty,
    identical, disjoint, one all-zero rank."""
    rng = np.random.default_rng(seed)
    ident = random_sparse(rng, n, 0.2)
    disjoint = []
    for r in range(P):
        d = np.zeros(n, np.float32)
        d[r::P] = r + 1
        disjoint.append(d)
    zero_one = [random_sparse(rng, n, 0.1) for _ in range(P)]
    zero_one[0][:] = 0
    return [[random_sparse(rng, n, 0.05) for _ in range(P)],
            [random_sparse(rng, n, 0.7) for _ in range(P)],
            [np.zeros(n, np.float32) for _ in range(P)],
            [ident.copy() for _ in range(P)],
            disjoint, zero_one]


def assert_same_everywhere(rs: Sequence[Any]) -> None:
    first = rs[0]
    for r in rs[1:]:
        assert type(r) is type(first)
        if isinstance(first, SparseVector):
            assert r == first
        else:
            assert np.array_equal(r, first)


def assert_canonical(r: Any, n: int) -> None:
    if isinstance(r, SparseVector):
        assert r.size == n
        assert np.all(r.indices[1:] > r.indices[:-1])
        assert r.nnz == 0 or (r.indices[0] >= 0 and r.indices[-1] < n)
        assert np.all(r.values != 0)


# -- comm.sparse_allreduce ---------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
async def test_exact_against_the_dense_sum(transport: str, P: int, shm: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # one host: the split algorithms take shared memory unless ASYNCCOLL_SHM=0
    monkeypatch.setenv("ASYNCCOLL_SHM", "1" if shm else "0")
    n = 37  # not divisible by 2, 3 or 4
    async with local_world(P, transport, timeout=20) as comms:
        for ci, xs in enumerate(cases(P, n, seed=P)):
            ref = np.sum(xs, axis=0)
            for alg in (*ALGORITHMS, None):
                sparse_in = ci % 2 == 0  # SparseVectors and dense arrays, alternately
                rs = await gather(*(c.sparse_allreduce(from_dense(x) if sparse_in else x,
                                                       density=0.05, algorithm=alg)
                                    for c, x in zip(comms, xs, strict=True)))
                assert_same_everywhere(rs)
                for r in rs:
                    assert_canonical(r, n)
                    assert np.array_equal(to_dense(r), ref), (ci, alg)
                if alg == "dsar_split_allgather":
                    assert isinstance(rs[0], np.ndarray)
                if ci == 2:  # everything zero: an empty sparse result
                    assert alg == "dsar_split_allgather" or rs[0].nnz == 0
        # one cached op per (size, dtype, algorithm, ...), built once: three algorithms
        # (None with density=0.05 resolves to one of them)
        assert all(len(c._sparse._entries) == 3 for c in comms)
        names = sorted(ex.schedule.name for ex in comms[0].live.executors()
                       if ex.schedule.name.startswith("sparse"))
        via = "/shm" if shm and P > 1 else ""
        assert names == ["sparse_allreduce/dsar_split_allgather" + via,
                         "sparse_allreduce/ssar_recursive_double",
                         "sparse_allreduce/ssar_split_allgather" + via], names


@pytest.mark.timeout(30)
async def test_results_are_new_and_dense_results_keep_the_shape() -> None:
    P = 3
    async with local_world(P) as comms:
        xs = [np.full((4, 5), r + 1, np.float64) for r in range(P)]
        keep = [x.copy() for x in xs]
        first = await gather(*(c.sparse_allreduce(x, algorithm="ssar_split_allgather")
                               for c, x in zip(comms, xs, strict=True)))
        assert all(isinstance(r, np.ndarray) and r.shape == (4, 5) for r in first)
        assert np.array_equal(first[0], np.full((4, 5), 6.0))
        second = await gather(*(c.sparse_allreduce(2 * x, algorithm="ssar_split_allgather")
                                for c, x in zip(comms, xs, strict=True)))
        assert np.array_equal(first[0], np.full((4, 5), 6.0))  # not overwritten by the reuse
        assert np.array_equal(second[1], np.full((4, 5), 12.0))
        assert all(np.array_equal(x, k) for x, k in zip(xs, keep, strict=True))


@pytest.mark.timeout(30)
async def test_quantized_dense_stage_agrees_on_every_rank() -> None:
    P, n = 3, 2000
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(P)]
    async with local_world(P) as comms:
        rs = await gather(*(c.sparse_allreduce(x, quantize=8, seed=3)
                            for c, x in zip(comms, xs, strict=True)))
        assert_same_everywhere(rs)
        ref = np.sum(xs, axis=0)
        # 8-bit QSGD: each entry within one level (scale / 127) of the sum
        assert float(np.max(np.abs(rs[0] - ref))) < 0.2
        assert all(c._sparse._entries for c in comms)


@pytest.mark.timeout(30)
async def test_bad_arguments_name_themselves_and_do_not_shift_ids() -> None:
    P = 2
    async with local_world(P) as comms:
        c0 = comms[0]
        x = from_dense(np.array([0, 1, 0, 2], np.float32))
        with pytest.raises(ValueError, match="density"):
            await c0.sparse_allreduce(x, density=2.0)
        with pytest.raises(ValueError, match="algorithm"):
            await c0.sparse_allreduce(x, algorithm="allgather")
        with pytest.raises(ValueError, match="bits"):
            await c0.sparse_allreduce(x, quantize=3)
        with pytest.raises(TypeError, match="x must be"):
            await c0.sparse_allreduce([0, 1, 2])
        with pytest.raises(ValueError, match="C-contiguous"):
            await c0.sparse_allreduce(np.zeros((4, 4), np.float32)[:, 0])
        # rank 0's failed calls took no schedule id: both ranks still agree
        rs = await gather(*(c.sparse_allreduce(x) for c in comms))
        assert to_dense(rs[0]).tolist() == [0, 2, 0, 4]


@pytest.mark.timeout(30)
async def test_timeout_then_clean_close() -> None:
    async with local_world(2, timeout=5) as comms:
        x = from_dense(np.arange(8, dtype=np.float32))
        with pytest.raises(CollectiveTimeoutError):
            await comms[0].sparse_allreduce(x, timeout=0.2)  # rank 1 never calls
        assert not comms[0]._sparse._entries  # the failed op was dropped
        await comms[0].close(timeout=0)  # rank 1 closes only at the end of the block
        with pytest.raises(TransportClosedError):
            await comms[0].sparse_allreduce(x)


@pytest.mark.timeout(30)
async def test_blocking_twin_from_threads() -> None:
    P = 3
    async with local_world(P) as comms:
        xs = [from_dense(np.eye(1, 9, r, dtype=np.float32).ravel()) for r in range(P)]
        rs = await gather(*(asyncio.to_thread(c.blocking.sparse_allreduce, x, 0.1)
                            for c, x in zip(comms, xs, strict=True)))
        assert_same_everywhere(rs)
        assert to_dense(rs[0]).tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0]


# -- comm.sparse_allreduce_handle --------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_handle_sums_like_the_collective_and_keeps_its_schedule() -> None:
    P, n = 3, 40
    async with local_world(P) as comms:
        hs = [c.sparse_allreduce_handle(n, np.float32, name="grads", density=0.05) for c in comms]
        assert (hs[0].algorithm, hs[0].name) == ("ssar_recursive_double", "grads")
        for ci, xs in enumerate(cases(P, n, 11)):
            rs = await gather(*(h(x) for h, x in zip(hs, xs, strict=True)))
            assert_same_everywhere(rs)
            assert np.array_equal(to_dense(rs[0]), np.sum(xs, axis=0)), ci
        # a name is one handle, taken until the handle is closed
        with pytest.raises(ValueError, match="already used"):
            comms[0].sparse_allreduce_handle(n, name="grads")
        with pytest.raises(TypeError, match="x must"):
            await hs[0]([1.0])
        with pytest.raises(ValueError, match="40"):
            await hs[0](np.zeros(n + 1, np.float32))
        await gather(*(h.close() for h in hs))
        with pytest.raises(TransportClosedError, match="grads"):
            await hs[0](np.zeros(n, np.float32))
        again = [c.sparse_allreduce_handle(n, name="grads") for c in comms]
        rs = await gather(*(h(np.ones(n, np.float32)) for h in again))
        assert np.array_equal(to_dense(rs[0]), np.full(n, P, np.float32))


@pytest.mark.timeout(30)
async def test_handle_closes_after_a_timeout_and_with_the_communicator() -> None:
    async with local_world(2, progress="inline", timeout=5) as comms:
        h0, h1 = (c.sparse_allreduce_handle(8, timeout=0.2) for c in comms)
        with pytest.raises(CollectiveTimeoutError):
            await h0(np.ones(8, np.float32))  # rank 1 never calls
        with pytest.raises(TransportClosedError):
            await h0(np.ones(8, np.float32))
        with pytest.raises(ValueError, match="density"):
            comms[0].sparse_allreduce_handle(8, density=2.0)
        await comms[1].close(timeout=0)  # rank 0 closes only at the end of the block
        with pytest.raises(TransportClosedError):
            await h1(np.ones(8, np.float32))


@pytest.mark.timeout(60)
async def test_handle_through_shared_memory_and_its_arguments() -> None:
    P, n = 4, 600
    async with local_world(P, progress="inline") as comms:
        # before the host layout is known (connect() learns it; local worlds do not)
        with pytest.raises(ValueError, match="shm=True needs every rank on one host"):
            comms[0].sparse_allreduce_handle(n, shm=True)
        assert not comms[0].sparse_allreduce_handle(n, algorithm="ssar_split_allgather").shm
        await gather(*(c.sync_clocks() for c in comms))
        for kw, form in [({"algorithm": "ssar_split_allgather"}, SparseVector),
                         ({"algorithm": "dsar_split_allgather"}, np.ndarray),
                         ({"shm": True, "density": 0.001}, SparseVector)]:
            hs = [c.sparse_allreduce_handle(n, name="h", **kw) for c in comms]
            assert all(h.shm and h.algorithm.endswith("split_allgather") for h in hs), hs
            for ci, xs in enumerate(cases(P, n, 5)):
                rs = await gather(*(h(x) for h, x in zip(hs, xs, strict=True)))
                assert_same_everywhere(rs)
                assert np.array_equal(to_dense(rs[0]), np.sum(xs, axis=0)), (kw, ci)
                if ci == 0:  # (sparse inputs: a SparseVector back unless DSAR)
                    assert isinstance(rs[0], form), (kw, type(rs[0]))
            await gather(*(h.close() for h in hs))
        # not through shared memory: asked not to, or quantised, or another algorithm
        assert not comms[0].sparse_allreduce_handle(n, algorithm="ssar_split_allgather",
                                                    shm=False).shm
        assert not comms[0].sparse_allreduce_handle(n, quantize=4).shm
        assert not comms[0].sparse_allreduce_handle(n, algorithm="ssar_recursive_double").shm
        for kw, what in [({"shm": True, "quantize": 4}, "quantised"),
                         ({"shm": True, "algorithm": "ssar_recursive_double"}, "split"),
                         ({"shm": "yes"}, "shm must be"),
                         ({"shm": True, "density": "x"}, "density must be")]:
            with pytest.raises(ValueError, match=what):
                comms[0].sparse_allreduce_handle(n, name="refused", **kw)
        # a refusal took no name: the next handle gets it
        comms[0].sparse_allreduce_handle(n, name="refused")
        # shm=True keeps the chooser's pick where it is a split one (dense data: DSAR)
        assert comms[0].sparse_allreduce_handle(n, shm=True, density=0.5).algorithm == \
            "dsar_split_allgather"


@pytest.mark.timeout(30)
async def test_handle_paths_chosen_differently_time_out_saying_so() -> None:
    async with local_world(2, progress="inline", timeout=5) as comms:
        await gather(*(c.sync_clocks() for c in comms))
        hs = [c.sparse_allreduce_handle(64, algorithm="ssar_split_allgather", shm=shm,
                                        timeout=0.5)
              for c, shm in zip(comms, (True, False), strict=True)]
        got = await asyncio.wait_for(asyncio.gather(
            *(h(np.ones(64, np.float32)) for h in hs), return_exceptions=True), 10)
        for g, path in zip(got, ("through shared memory", "over the network"), strict=True):
            assert isinstance(g, CollectiveTimeoutError), g
            assert "the first call of sparse handle" in str(g), g
            assert path in str(g), g
            assert g.pending  # what it waited on, as any timeout says


# -- sparse contributions in partial collectives ----------------------------------------------

N = 16  # delta = 8 for float64 with int32 indices: accumulated data turns dense


def sv(rank: int, scale: int = 1) -> SparseVector:
    a = float(10**rank * scale)
    return SparseVector([2 * rank, 2 * rank + 1], [a, -a], N)


def total(ranks: Sequence[int], scale: int = 1) -> np.ndarray:
    out = np.zeros(N)
    for r in ranks:
        out += to_dense(sv(r, scale))
    return out


def like() -> SparseVector:
    return SparseVector(np.empty(0, np.int32), np.empty(0, np.float64), N)


def handles(comms: Sequence[Any], kind: str, quorum: int | None = None,
            **kw: Any) -> list[Any]:
    return [c.partial_allreduce(policy_of(kind, quorum), like=like(), **kw) for c in comms]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
@pytest.mark.parametrize(("algorithm", "shm"), [(a, False) for a in ALGORITHMS] + [
    ("ssar_split_allgather", True), ("dsar_split_allgather", True)])
async def test_partial_no_stragglers_equals_the_sum(kind: str, quorum: int | None,
                                                    algorithm: str, shm: bool) -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        if shm:  # the host layout, known: the data phase through shared memory
            await gather(*(c.sync_clocks() for c in comms))
        hs = handles(comms, kind, quorum, path=DataPath(algorithm=algorithm, shm=shm))
        assert all((h._segments is not None) == shm for h in hs)
        for rnd in range(2):
            rs = await gather(*(h(sv(r, rnd + 1)) for r, h in enumerate(hs)))
            for res in rs:
                assert isinstance(res, PartialResult)
                assert np.array_equal(to_dense(res.value), total(range(P), rnd + 1))
                assert isinstance(res.value, np.ndarray if algorithm ==
                                  "dsar_split_allgather" else SparseVector)
                assert (res.round, res.included, res.missed) == (rnd, True, 0)
                assert res.contributors == frozenset(range(P)) == res.fresh
                assert res.count == P
        await gather(*(h.flush() for h in hs))


@pytest.mark.timeout(30)
async def test_partial_solo_exact_sequence() -> None:
    P = 3
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "solo")
        (r0,) = await gather(h[0](sv(0)))
        assert r0.value == sv(0)  # rank 0 alone; the others contributed nothing
        assert (r0.round, r0.included, r0.contributors, r0.count) == (0, True, frozenset({0}), 1)
        # execution 0 is over: at once, not included, data kept for later (rank 2's is a
        # dense array)
        for r, x in ((1, sv(1)), (2, to_dense(sv(2)) + 1)):
            (res,) = await gather(h[r](x))
            assert res.value == sv(0)
            assert (res.round, res.included, res.missed) == (0, False, 1)
        (res,) = await gather(h[0](sv(0)))
        assert np.array_equal(to_dense(res.value), total([0, 1, 2]) + 1)
        assert isinstance(res.value, np.ndarray)  # the sum passed delta: dense
        assert (res.round, res.included, res.fresh) == (1, True, frozenset({0}))
        assert res.contributors == frozenset({0, 1, 2})
        assert res.count == 3
        (res1,) = await gather(h[1](sv(1, 7)))
        assert (res1.round, res1.included, res1.missed) == (1, False, 1)
        fl = await gather(*(x.flush() for x in h))
        for res in fl:
            assert (res.round, res.included, res.flushed) == (2, True, True)
            assert res.value == sv(1, 7)
            assert res.contributors == frozenset({1})


@pytest.mark.timeout(30)
async def test_partial_majority_waits_for_its_initiator() -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        h = handles(comms, "majority", path=DataPath(algorithm="ssar_recursive_double"))
        (i,) = initiators("majority", 0, P, h[0].seed)
        others = [r for r in range(P) if r != i]
        waiting = [asyncio.ensure_future(h[r](sv(r))) for r in others]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiting)
        (ri,) = await gather(h[i](sv(i)))
        for res in [ri, *await gather(*waiting)]:
            assert np.array_equal(to_dense(res.value), total(range(P)))
            assert (res.round, res.included) == (0, True)
            assert res.fresh == frozenset(range(P))
        (j,) = initiators("majority", 1, P, h[0].seed)
        (rj,) = await gather(h[j](sv(j, 2)))
        assert rj.value == sv(j, 2)
        assert rj.contributors == frozenset({j})
        for r in range(P):
            if r != j:
                (res,) = await gather(h[r](sv(r, 2)))
                assert (res.round, res.included, res.missed) == (1, False, 1)
                assert res.value == sv(j, 2)
        fl = await gather(*(x.flush() for x in h))
        expect = total([r for r in range(P) if r != j], 2)
        assert all(np.array_equal(to_dense(f.value), expect) for f in fl)


@pytest.mark.timeout(30)
async def test_partial_activated_from_outside_before_the_call() -> None:
    # Recursive doubling at P=4: rank 3 is activated through rank 2 at once, but the link from
    # rank 1 is slow, so its execution is under way when it calls: included=False, and its
    # data goes into the next execution exactly once.
    P = 4
    async with local_world(P, progress="inline", link_delay={(1, 3): 0.3}) as comms:
        h = handles(comms, "solo", path=DataPath(algorithm="ssar_recursive_double"))
        t0 = asyncio.ensure_future(h[0](sv(0)))
        await asyncio.sleep(0.05)
        assert h[3]._state[SNAPSHOTS] == 1
        assert h[3].completed == -1
        (r3,) = await gather(h[3](sv(3)))
        assert (r3.round, r3.included, r3.missed) == (0, False, 0)
        assert r3.value == sv(0)
        assert r3.contributors == frozenset({0})
        (r0,) = await gather(t0)
        assert (r0.value, r0.included) == (sv(0), True)
        (r0,) = await gather(h[0](sv(0, 2)))
        assert np.array_equal(to_dense(r0.value), total([0], 2) + total([3]))
        assert r0.contributors == frozenset({0, 3})
        fl = await gather(*(x.flush() for x in h))
        assert all(f.value.nnz == 0 and f.count == 0 for f in fl[1:3])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
async def test_partial_conservation_after_flush(kind: str, quorum: int | None,
                                                shm: bool) -> None:
    P, T = 4, 8
    rng = random.Random(7)
    pauses = [[rng.uniform(0, 0.004) for _ in range(T)] for _ in range(P)]
    contributed = sum(total([r], t + 1) for r in range(P) for t in range(T))
    async with local_world(P, progress="inline") as comms:
        if shm:
            await gather(*(c.sync_clocks() for c in comms))
        hs = handles(comms, kind, quorum, accumulate=Accumulate.SUM, path=DataPath(shm=shm))
        assert all((h._segments is not None) == shm for h in hs)

        async def rank_main(r: int) -> list[PartialResult]:
            got = []
            for t in range(T):
                await asyncio.sleep(pauses[r][t])
                got.append(await hs[r](sv(r, t + 1), timeout=10))
            got.append(await hs[r].flush(timeout=10))
            return got

        out = await asyncio.wait_for(asyncio.gather(*(rank_main(r) for r in range(P))), 60)
    for r in range(P):
        assert np.array_equal(sum(to_dense(g.value) for g in out[r]), contributed), (kind, r)
        assert sum(g.count for g in out[r]) == P * T
        assert [g.round for g in out[r]] == sorted(g.round for g in out[r])
    assert len({o[-1].round for o in out}) == 1


@pytest.mark.timeout(30)
async def test_partial_sparse_arguments() -> None:
    async with local_world(2, progress="inline") as comms:
        c = comms[0]
        with pytest.raises(ValueError, match="op must be 'sum'"):
            c.partial_allreduce(Solo(), like=like(), op="max")
        with pytest.raises(ValueError, match="density"):
            c.partial_allreduce(Solo(), like=np.zeros(3), path=DataPath(density=0.1))
        with pytest.raises(ValueError, match="algorithm"):
            c.partial_allreduce(Solo(), like=like(), path=DataPath(algorithm='ring'))
        h = c.partial_allreduce(Solo(), like=like(), name="s")
        with pytest.raises(ValueError, match="size 16"):
            await h(SparseVector([1], [1.0], N + 1))
        with pytest.raises(ValueError, match="16 entries"):
            await h(np.zeros(N, np.float32))
        with pytest.raises(TypeError, match="SparseVector"):
            await h([1.0])
        with pytest.raises(ValueError, match="combine"):
            await h(sv(0), combine=lambda acc, x, n, late: n + 1)
        assert "SparsePartialAllreduce" in repr(h)


@pytest.mark.timeout(30)
async def test_partial_shortcuts_and_progress_thread() -> None:
    P = 3
    async with local_world(P) as comms:
        rs = await gather(*(c.solo_allreduce(sv(r)) for r, c in enumerate(comms)))
        # one handle per kind, size and dtype, whatever the vector's entries
        hs = [c._shortcut("solo", sv(r)) for r, c in enumerate(comms)]
        assert all(h is c._shortcut("solo", like()) for h, c in zip(hs, comms, strict=True))
        fl = await gather(*(h.flush() for h in hs))
        for res in (*rs, *fl):  # each rank contributed once: the value names its contributors
            assert np.array_equal(to_dense(res.value), total(sorted(res.contributors)))
        assert any(r.included for r in rs)


# -- real processes ----------------------------------------------------------------------------

async def rank_main(rank: int, P: int, port: int, transport: str) -> str:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport=transport, timeout=60)
    async with comm:
        n = 1000
        xs = cases(P, n, seed=11)[0]
        ref = np.sum(xs, axis=0)
        for alg in ALGORITHMS:
            r = await comm.sparse_allreduce(from_dense(xs[rank]), algorithm=alg, timeout=30)
            assert np.array_equal(to_dense(r), ref), alg
        h = comm.partial_allreduce(Majority(), like=SparseVector([], np.zeros(0), 8),
                                   accumulate=Accumulate.SUM)
        got = np.zeros(8)
        for t in range(5):
            await asyncio.sleep(0.002 * rank)
            got += to_dense((await h(SparseVector([rank], [float(t + 1)], 8), timeout=30)).value)
        got += to_dense((await h.flush(timeout=30)).value)
        assert np.array_equal(got[:P], np.full(P, 15.0)), got
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.2)  # let peers read our last frames before we close
        return type(comm.transport).__name__


def run_world(P: int, transport: str, timeout: float = 90.0) -> list[str]:
    return spawn_world(async_child, P, (rank_main, free_port(), transport), timeout)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(
        not HAVE_UCX, reason="ucxx is not installed (pip install 'asynccoll[ucx]')")),
])
@pytest.mark.parametrize("P", [2, 3])
def test_real_processes(transport: str, P: int) -> None:
    names = run_world(P, transport)
    assert names == [{"tcp": "TcpTransport", "ucx": "UcxTransport"}[transport]] * P
