"""The simulated sparse allreduce equals the runtime's, bit for bit, and is priced by its data."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives.sparse.streams import SparseVector
from asynccoll.comm.sparse import SparseAllreduce
from asynccoll.sim import SimSparse, SimWorld
from asynccoll.testing import inproc_world

from ._script import FAST

SIZE = 4000


def inputs(P: int, density: float, seed: int) -> list[np.ndarray]:
    """Rank r's vector: ``density`` of the entries nonzero, small integers (exact sums)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(P):
        x = np.zeros(SIZE, np.float32)
        idx = rng.choice(SIZE, max(1, int(density * SIZE)), replace=False)
        x[idx] = rng.integers(1, 9, idx.size)
        out.append(x)
    return out


def dense(res: Any) -> np.ndarray:
    return res.to_dense() if isinstance(res, SparseVector) else np.asarray(res)


async def runtime(xs: list[np.ndarray], rounds: int, **kw: Any) -> list[list[Any]]:
    """Every rank runs ``rounds`` sparse allreduces of its vector (scaled by the round)."""
    P = len(xs)
    async with inproc_world(P) as ts:
        ops = [SparseAllreduce(t, SIZE, np.float32, sched_id=9, **kw) for t in ts]

        async def rank(r: int) -> list[Any]:
            return [await ops[r].run(xs[r] * (j + 1), timeout=20) for j in range(rounds)]

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))),
                                               30))
        finally:
            for op in ops:
                op.close()


def simulated(xs: list[np.ndarray], rounds: int, **kw: Any) -> tuple[list[list[Any]], float]:
    """The same in virtual time, ranks entering in a scrambled order; (results, end time)."""
    P = len(xs)
    w = SimWorld(P, FAST)
    sp = SimSparse(w, SIZE, np.float32, **kw)
    got: list[list[Any]] = [[] for _ in range(P)]

    def back(res: Any, r: int) -> None:
        got[r].append(res)
        if len(got[r]) < rounds:
            sp.call(r, xs[r] * (len(got[r]) + 1), back)

    for r in range(P):
        w.at(((r * 7) % P) * 1e-4, sp.call, r, xs[r], back)
    w.run()
    return got, w.now


CASES = [("ssar_recursive_double", None), ("ssar_split_allgather", None),
         ("dsar_split_allgather", None), ("dsar_split_allgather", 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("algorithm", "quantize"), CASES)
@pytest.mark.parametrize("P", [3, 4, 8])
async def test_sparse_equals_runtime(algorithm: str, quantize: int | None, P: int) -> None:
    xs = inputs(P, 0.01, seed=P)
    kw = {"algorithm": algorithm, "quantize": quantize, "seed": 5}
    rt = await runtime(xs, 2, **kw)
    sim, _ = simulated(xs, 2, **kw)
    for r in range(P):
        assert len(sim[r]) == 2
        for j in range(2):
            assert type(sim[r][j]) is type(rt[r][j]), (r, j)
            np.testing.assert_array_equal(dense(sim[r][j]), dense(rt[r][j]),
                                          err_msg=f"rank {r} round {j}")
    if quantize is None:  # exact: the sum itself
        np.testing.assert_array_equal(dense(sim[0][1]), 2 * np.sum(xs, axis=0))


@pytest.mark.timeout(60)
def test_priced_by_the_data_sent() -> None:
    """Sparser inputs take less virtual time: a send costs its payload's bytes, not its slot's
    capacity (the dense switch included: a dense input costs the most)."""
    times = []
    for density in (0.001, 0.05, 1.0):
        xs = inputs(8, density, seed=1)
        _, t = simulated(xs, 1, algorithm="ssar_split_allgather")
        times.append(t)
    assert times[0] < times[1] < times[2], times


def test_bad_arguments() -> None:
    w = SimWorld(2, FAST)
    sp = SimSparse(w, SIZE, np.float32, algorithm="ssar_recursive_double")
    with pytest.raises(ValueError, match="size 3"):
        sp.call(0, np.zeros(3, np.float32), lambda res, r: None)
    sp.call(0, np.zeros(SIZE, np.float32), lambda res, r: None)
    with pytest.raises(ValueError, match="already"):
        sp.call(0, np.zeros(SIZE, np.float32), lambda res, r: None)
    with pytest.raises(ValueError, match="algorithm"):
        SimSparse(w, SIZE, algorithm="nope")
