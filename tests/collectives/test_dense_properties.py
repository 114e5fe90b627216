"""Property tests: any P, count, segment size, algorithm and delay seed gives NumPy's result."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccoll.collectives import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    allgather,
    allreduce,
    block_bounds,
    broadcast,
    reduce_scatter,
    scratch_buffers,
)
from asynccoll.sched import Executor
from asynccoll.testing import inproc_world

SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


async def _execute(P: int, scheds: list[Any], bufs: list[Any], seed: int) -> None:
    async with inproc_world(P, delay=0.0005 if seed % 2 else 0.0, seed=seed) as ts:
        exs = [Executor(s, t, b, sched_id=1) for s, t, b in zip(scheds, ts, bufs, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.start() for e in exs)), 10)


@pytest.mark.timeout(60)
@SETTINGS
@given(P=st.integers(1, 12), n=st.integers(0, 300), seg_elems=st.integers(1, 80),
       algorithm=st.sampled_from(ALLREDUCE_ALGORITHMS), op=st.sampled_from(["sum", "max"]),
       seed=st.integers(0, 1000))
def test_allreduce_property(P: int, n: int, seg_elems: int, algorithm: str, op: str,
                            seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(P)]
    scheds = [allreduce(r, P, n, "int64", op, algorithm, segment_bytes=8 * seg_elems)
              for r in range(P)]
    bufs = [{"data": xs[r].copy(), **scratch_buffers(scheds[r])} for r in range(P)]
    asyncio.run(_execute(P, scheds, bufs, seed))
    ref = (np.add if op == "sum" else np.maximum).reduce(np.stack(xs), axis=0)
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"], ref)


@pytest.mark.timeout(60)
@SETTINGS
@given(P=st.integers(1, 12), n=st.integers(0, 60), seg_elems=st.integers(1, 40),
       algorithm=st.sampled_from(ALLGATHER_ALGORITHMS), seed=st.integers(0, 1000))
def test_allgather_and_reduce_scatter_property(P: int, n: int, seg_elems: int, algorithm: str,
                                               seed: int) -> None:
    full = np.arange(P * n, dtype=np.int32) * 7 + 1
    scheds = [allgather(r, P, n, "int32", algorithm, segment_bytes=4 * seg_elems)
              for r in range(P)]
    bufs = []
    for r in range(P):
        d = np.zeros(P * n, np.int32)
        d[r * n:(r + 1) * n] = full[r * n:(r + 1) * n]
        bufs.append({"data": d, **scratch_buffers(scheds[r])})
    asyncio.run(_execute(P, scheds, bufs, seed))
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"], full)
    # reduce-scatter of the gathered vectors: every rank holds P copies summed
    m = P * n
    scheds = [reduce_scatter(r, P, m, "int32", "sum", segment_bytes=4 * seg_elems)
              for r in range(P)]
    bufs = [{"data": full.copy(), **scratch_buffers(scheds[r])} for r in range(P)]
    asyncio.run(_execute(P, scheds, bufs, seed + 1))
    b = block_bounds(m, P)
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"][b[r]:b[r + 1]], P * full[b[r]:b[r + 1]])


@pytest.mark.timeout(60)
@SETTINGS
@given(P=st.integers(1, 12), n=st.integers(0, 200), seg_elems=st.integers(1, 50),
       algorithm=st.sampled_from(BROADCAST_ALGORITHMS), root_frac=st.floats(0, 0.999),
       seed=st.integers(0, 1000))
def test_broadcast_property(P: int, n: int, seg_elems: int, algorithm: str, root_frac: float,
                            seed: int) -> None:
    root = int(root_frac * P)
    src = np.arange(n, dtype=np.float32) - 3.5
    scheds = [broadcast(r, P, n, "float32", root, algorithm, segment_bytes=4 * seg_elems)
              for r in range(P)]
    bufs = [{"data": src.copy() if r == root else np.full(n, np.nan, np.float32)}
            for r in range(P)]
    asyncio.run(_execute(P, scheds, bufs, seed))
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"], src)
