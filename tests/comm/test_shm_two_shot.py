"""The two-shot shared-memory allreduce's copy in (asynccoll.comm.shm): each rank copies into
its segment only the blocks its peers reduce, tells each peer once that peer's block is in, and
reduces its own block straight out of the caller's array.

In one process: every rank's "segment" is a NumPy array that the other ranks' schedules read
through read-only views (a write to a peer's segment raises), the wake-ups go over inproc
transports with seeded random delays (so messages of different rounds overtake each other).
The multi-process tests (test_shm.py, test_shm_one_shot.py) run the same schedules over real
segments and tcp.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccoll.collectives._plan import block_bounds
from asynccoll.collectives.dense import scratch_buffers
from asynccoll.collectives.shm import build_hier_allreduce, build_shm_allreduce
from asynccoll.sched import BufRef, Schedule
from asynccoll.testing import inproc_world, run_schedules

OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _data(n: int, rank: int, dtype: Any) -> np.ndarray[Any, Any]:
    # small integers (exact in every dtype and in any order of reduction), some negative
    return ((np.arange(n) * (rank + 3)) % 5 - (rank % 3)).astype(dtype)


def _want(n: int, ranks: list[int], dtype: Any, op: str) -> np.ndarray[Any, Any]:
    out = _data(n, ranks[0], dtype)
    for q in ranks[1:]:
        OPS[op](out, _data(n, q, dtype), out=out)
    return out


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    v = a.view()
    v.flags.writeable = False
    return v


def _copies_into_mine(s: Schedule) -> dict[int, tuple[int, int]]:
    """The copy ops that write this rank's segment: op index -> (offset, count)."""
    out = {}
    for i, op in enumerate(s.ops):
        if op.kind == "compute" and op.kernel == "copy" and op.output is not None \
                and op.output.slot == "mine":
            ref = op.output
            n = s.slots["mine"].count if ref.count is None else ref.count
            assert n is not None
            out[i] = (ref.offset, n)
    return out


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 3, 7, 1003])
def test_two_shot_copies_in_only_the_peers_blocks(P: int, n: int) -> None:
    b = block_bounds(n, P)
    for r in range(P):
        s = build_shm_allreduce(r, P, n, np.float32, algorithm="two_shot")
        copies = _copies_into_mine(s)
        # exactly the other ranks' blocks, each once; this rank's own block is not copied in
        assert sorted(copies.values()) == sorted((b[j], b[j + 1] - b[j])
                                                 for j in range(P) if j != r)
        # the "copied in" message to q follows the copy of q's block
        for op in s.ops:
            if op.kind == "send" and op.label == "copied in":
                j = op.peer
                (dep,) = op.deps
                assert copies[dep] == (b[j], b[j + 1] - b[j])
        # the reduce reads this rank's block of the caller's array, not of its segment
        (red,) = [op for op in s.ops if op.kind == "compute" and op.kernel == "sum"]
        assert red.inputs[0] == BufRef("data", b[r], b[r + 1] - b[r])
        assert red.output == BufRef("mine", b[r], b[r + 1] - b[r])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("op", "dtype"), [("sum", np.float32), ("prod", np.int64),
                                           ("min", np.float64), ("max", np.int32),
                                           ("sum", np.bool_)])
async def test_two_shot_equals_numpy_with_random_delays(P: int, op: str, dtype: Any) -> None:
    for n in sorted({1, max(1, P - 1), 7, 1003}):
        for seed in range(3):
            segs = [np.zeros(n, dtype) for _ in range(P)]
            data = [_data(n, r, dtype) for r in range(P)]
            scheds, bufs = [], []
            for r in range(P):
                scheds.append(build_shm_allreduce(r, P, n, dtype, op, algorithm="two_shot"))
                bufs.append({"data": data[r], "mine": segs[r],
                             **{f"peer{q}": _readonly(segs[q]) for q in range(P) if q != r}})
            async with inproc_world(P, delay=0.002, seed=seed) as ts:
                await run_schedules(ts, scheds, bufs, timeout=20)
            want = _want(n, list(range(P)), dtype, op)
            for r in range(P):
                assert data[r].dtype == want.dtype
                assert np.array_equal(data[r], want), (P, op, n, seed, r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0], [1, 2]], [[0, 3], [1, 2, 4]]],
                         ids=["2x2", "1+2", "2+3"])
async def test_hierarchical_equals_numpy_with_random_delays(groups: list[list[int]]) -> None:
    P = sum(len(g) for g in groups)
    for n in (1, 5, 1001):
        for seed in range(2):
            segs = [np.zeros(n, np.float64) for _ in range(P)]
            data = [_data(n, r, np.float64) for r in range(P)]
            scheds, bufs = [], []
            for r in range(P):
                s = build_hier_allreduce(r, P, n, np.float64, "sum", groups)
                g = next(g for g in groups if r in g)
                scheds.append(s)
                bufs.append({"data": data[r], "mine": segs[r], **scratch_buffers(s),
                             **{f"peer{q}": _readonly(segs[q]) for q in g if q != r}})
            async with inproc_world(P, delay=0.002, seed=seed) as ts:
                await run_schedules(ts, scheds, bufs, timeout=20)
            want = _want(n, list(range(P)), np.float64, "sum")
            for r in range(P):
                assert np.array_equal(data[r], want), (groups, n, seed, r)
