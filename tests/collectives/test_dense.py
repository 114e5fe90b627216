"""Dense collectives over inproc: results equal NumPy's, for every P in 1..9 and algorithm."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    allgather,
    allreduce,
    barrier,
    block_bounds,
    broadcast,
    build_allreduce,
    next_tag,
    reduce_scatter,
    scratch_buffers,
    scratch_slots,
)
from asynccoll.sched import Executor, Schedule
from asynccoll.testing import inproc_world

REF = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_ids = itertools.count(100)

# (op, dtype) cases; complex min/max is left to NumPy's lexicographic order and not tested
CASES = [
    ("sum", "int32"), ("sum", "float32"), ("sum", "float64"), ("sum", "complex64"),
    ("prod", "int64"), ("prod", "float64"), ("prod", "complex64"),
    ("min", "float32"), ("min", "int64"), ("max", "int32"), ("max", "float64"),
    ("sum", "bool"), ("prod", "bool"), ("max", "uint8"), ("sum", "float16"),
]


def inputs(P: int, n: int, op: str, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """Per-rank inputs whose reduction is exact in the dtype in any order (so results must be
    equal, not merely close): small integers for sums, powers of two for products."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    out = []
    for _ in range(P):
        if dt.kind == "b":
            x = rng.integers(0, 2, n).astype(bool)
        elif dt.kind == "c":
            lo, hi = (-1, 2) if op == "prod" else (-5, 6)
            x = (rng.integers(lo, hi, n) + 1j * rng.integers(lo, hi, n)).astype(dt)
        elif op == "prod" and dt.kind == "f":
            x = rng.choice(np.array([0.5, 1.0, 2.0, -1.0]), n).astype(dt)
        elif dt.kind == "u":
            x = rng.integers(0, 200, n).astype(dt)
        else:
            x = rng.integers(-5, 6, n).astype(dt)
        out.append(x)
    return out


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    return REF[op].reduce(np.stack(xs), axis=0, dtype=xs[0].dtype)


async def run(ts: list[Any], scheds: list[Schedule], bufs: list[dict[str, Any]],
              timeout: float = 20.0) -> None:
    """One execution of each rank's schedule, on a fresh schedule id."""
    sid = next(_ids)
    exs = [Executor(s, t, b, sched_id=sid) for s, t, b in zip(scheds, ts, bufs, strict=True)]
    try:
        await asyncio.wait_for(asyncio.gather(*(ex.start() for ex in exs)), timeout)
    finally:
        for ex in exs:
            ex.close()


async def check_allreduce(ts: list[Any], n: int, op: str, dtype: str, algorithm: str | None,
                          seed: int = 0, **kw: Any) -> list[np.ndarray]:
    P = len(ts)
    xs = inputs(P, n, op, dtype, seed)
    scheds = [allreduce(r, P, n, dtype, op, algorithm, **kw) for r in range(P)]
    bufs = [{"data": xs[r].copy(), **scratch_buffers(scheds[r])} for r in range(P)]
    await run(ts, scheds, bufs)
    ref = reference(xs, op)
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"], ref,
                                      err_msg=f"P={P} n={n} {op} {dtype} {algorithm} rank {r}")
    return [b["data"] for b in bufs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("P", range(1, 10))
async def test_allreduce_equals_numpy(P: int, algorithm: str) -> None:
    sizes = sorted({0, 1, max(P - 1, 0), P + 1, 37})
    async with inproc_world(P) as ts:
        for n in sizes:
            for op, dtype in CASES:
                await check_allreduce(ts, n, op, dtype, algorithm)
        # many small segments: segment boundaries cut through blocks
        await check_allreduce(ts, 101, "sum", "int64", algorithm, segment_bytes=24)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
async def test_allreduce_million_elements(P: int, algorithm: str) -> None:
    async with inproc_world(P) as ts:
        await check_allreduce(ts, 10**6 + 3, "sum", "float32", algorithm)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("P", [3, 4, 6])
async def test_allreduce_random_floats_bitwise_identical_on_every_rank(P: int) -> None:
    rng = np.random.default_rng(P)
    n = 1000
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(P)]
    async with inproc_world(P) as ts:
        for algorithm in ALLREDUCE_ALGORITHMS:
            scheds = [allreduce(r, P, n, "float32", "sum", algorithm, segment_bytes=512)
                      for r in range(P)]
            bufs = [{"data": xs[r].copy(), **scratch_buffers(scheds[r])} for r in range(P)]
            await run(ts, scheds, bufs)
            for r in range(1, P):
                assert bufs[r]["data"].tobytes() == bufs[0]["data"].tobytes(), algorithm
            np.testing.assert_allclose(bufs[0]["data"], np.sum(xs, axis=0, dtype=np.float64),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("P", "seed"), [(3, 1), (5, 2), (8, 3)])
async def test_allreduce_under_random_delays(P: int, seed: int) -> None:
    async with inproc_world(P, delay=0.002, seed=seed) as ts:
        for algorithm in ALLREDUCE_ALGORITHMS:
            for n in (1, P + 1, 203):
                await check_allreduce(ts, n, "sum", "int64", algorithm, seed=n,
                                      segment_bytes=64)
            await check_allreduce(ts, 50, "max", "float64", algorithm)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
async def test_allreduce_persistent_reexecution(algorithm: str, persistent: bool) -> None:
    P, n = 5, 23
    scheds = [allreduce(r, P, n, "int64", "sum", algorithm, segment_bytes=32) for r in range(P)]
    bufs = [{"data": np.zeros(n, np.int64), **scratch_buffers(scheds[r])} for r in range(P)]
    async with inproc_world(P, delay=0.001, seed=7) as ts:
        exs = [Executor(s, t, b, sched_id=5, persistent=persistent)
               for s, t, b in zip(scheds, ts, bufs, strict=True)]
        try:
            for e in range(4):
                xs = inputs(P, n, "sum", "int64", seed=e)
                for r in range(P):
                    bufs[r]["data"][:] = xs[r]
                done = await asyncio.wait_for(asyncio.gather(*(x.start() for x in exs)), 10)
                assert done == [e] * P
                for r in range(P):
                    np.testing.assert_array_equal(bufs[r]["data"], reference(xs, "sum"))
        finally:
            for ex in exs:
                ex.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", range(1, 10))
async def test_broadcast_from_every_root(P: int) -> None:
    async with inproc_world(P) as ts:
        for algorithm, root, n in itertools.product(BROADCAST_ALGORITHMS, range(P),
                                                    (0, 1, P - 1, P + 1, 301)):
            scheds = [broadcast(r, P, n, "float64", root, algorithm, segment_bytes=256)
                      for r in range(P)]
            src = np.arange(n, dtype=np.float64) + 0.5
            bufs = [{"data": src.copy() if r == root else np.full(n, -1.0)} for r in range(P)]
            await run(ts, scheds, bufs)
            for r in range(P):
                np.testing.assert_array_equal(bufs[r]["data"], src,
                                              err_msg=f"{algorithm} root {root} n={n}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", range(1, 10))
async def test_allgather(P: int) -> None:
    async with inproc_world(P, delay=0.001, seed=P) as ts:
        for algorithm, (n, dtype) in itertools.product(
                ALLGATHER_ALGORITHMS, ((0, "int32"), (1, "int32"), (P + 2, "complex64"),
                                       (77, "uint8"))):
            scheds = [allgather(r, P, n, dtype, algorithm, segment_bytes=16) for r in range(P)]
            full = (np.arange(P * n) % 251).astype(dtype)
            bufs = []
            for r in range(P):
                d = np.zeros(P * n, dtype)
                d[r * n:(r + 1) * n] = full[r * n:(r + 1) * n]
                bufs.append({"data": d, **scratch_buffers(scheds[r])})
            await run(ts, scheds, bufs)
            for r in range(P):
                np.testing.assert_array_equal(bufs[r]["data"], full,
                                              err_msg=f"{algorithm} n={n} rank {r}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", range(1, 10))
async def test_reduce_scatter(P: int) -> None:
    algorithms = ["ring"] + (["recursive_halving"] if P & (P - 1) == 0 else [])
    async with inproc_world(P) as ts:
        for algorithm, n, (op, dtype) in itertools.product(
                algorithms, (0, 1, P - 1, P, 3 * P + 2, 250),
                (("sum", "int64"), ("min", "float32"), ("prod", "float64"))):
            xs = inputs(P, n, op, dtype, seed=n)
            scheds = [reduce_scatter(r, P, n, dtype, op, algorithm, segment_bytes=32)
                      for r in range(P)]
            bufs = [{"data": xs[r].copy(), **scratch_buffers(scheds[r])} for r in range(P)]
            await run(ts, scheds, bufs)
            ref = reference(xs, op)
            b = block_bounds(n, P)
            for r in range(P):
                np.testing.assert_array_equal(bufs[r]["data"][b[r]:b[r + 1]],
                                              ref[b[r]:b[r + 1]],
                                              err_msg=f"{algorithm} n={n} rank {r}")


def test_block_bounds_follow_array_split() -> None:
    for n, P in itertools.product((0, 1, 5, 10, 17), (1, 3, 4, 7)):
        b = block_bounds(n, P)
        sizes = [len(c) for c in np.array_split(np.arange(n), P)]
        assert [b[i + 1] - b[i] for i in range(P)] == sizes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
async def test_barrier_waits_for_the_last_rank(P: int) -> None:
    loop = asyncio.get_running_loop()
    stagger = 0.01
    async with inproc_world(P, delay=0.002, seed=P) as ts:
        scheds = [barrier(r, P) for r in range(P)]
        exs = [Executor(s, t, {}, sched_id=9) for s, t in zip(scheds, ts, strict=True)]
        entered: dict[int, float] = {}
        left: dict[int, float] = {}

        def enter(r: int) -> None:
            entered[r] = loop.time()
            exs[r].start().add_done_callback(lambda _f: left.setdefault(r, loop.time()))

        order = list(range(P))[::-1]  # the last rank enters first, rank 0 last
        for i, r in enumerate(order):
            loop.call_later(i * stagger, enter, r)
        await asyncio.wait_for(asyncio.gather(*(ex.current for ex in exs)), 10)
        assert len(left) == P
        last_entry = max(entered.values())
        assert min(left.values()) >= last_entry
        for ex in exs:
            ex.close()


def test_scratch_slots_declared_with_sizes() -> None:
    s = allreduce(2, 6, 100, "float32", algorithm="ring")
    assert scratch_slots(s) == {"tmp": 2 * 17}
    assert s.slots["data"].count == 100
    assert s.slots["data"].dtype == "float32"
    assert s.slots["tmp"].dtype == "float32"
    assert scratch_slots(allreduce(0, 5, 100, "int8", algorithm="rabenseifner")) == {"tmp": 100}
    assert scratch_slots(allreduce(0, 1, 100, "int8")) == {}
    assert scratch_slots(allreduce(0, 4, 0, "int8")) == {}
    bufs = scratch_buffers(s)
    assert bufs["tmp"].dtype == np.float32
    assert bufs["tmp"].size == 34
    # several dtypes in one schedule: each scratch slot gets its own
    c = Schedule(0, 4)
    build_allreduce(c, 10, "float32", algorithm="ring")
    build_allreduce(c, 8, "int64", slot="meta", scratch_prefix="meta_", tag_base=next_tag(c))
    bufs = scratch_buffers(c, like=np.zeros(3, np.float32))
    assert {k: (v.dtype, v.size) for k, v in bufs.items()} == {
        "tmp": (np.float32, 6), "meta_tmp": (np.int64, 8)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
async def test_allreduce_every_wire_dtype(algorithm: str) -> None:
    dtypes = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "complex64", "complex128"]
    async with inproc_world(3) as ts:
        for dtype in dtypes:
            for op in ("sum", "max"):
                if dtype.startswith("complex") and op == "max":
                    continue
                await check_allreduce(ts, 11, op, dtype, algorithm)


@pytest.mark.timeout(30)
async def test_persistent_schedule_writes_nothing_before_the_rank_starts() -> None:
    """The root may run ahead into the next execution; a receiver's buffer must stay untouched
    until the receiver itself starts that execution (then it gets the root's new data)."""
    P, n = 3, 8
    scheds = [broadcast(r, P, n, "int64", root=0) for r in range(P)]
    bufs = [{"data": np.zeros(n, np.int64)} for _ in range(P)]
    async with inproc_world(P) as ts:
        exs = [Executor(s, t, b, sched_id=3, persistent=True)
               for s, t, b in zip(scheds, ts, bufs, strict=True)]
        try:
            bufs[0]["data"][:] = 1
            await asyncio.wait_for(asyncio.gather(*(e.start() for e in exs)), 10)
            assert all((b["data"] == 1).all() for b in bufs)
            for r in (1, 2):
                bufs[r]["data"][:] = -7  # the application reuses its buffer between calls
            bufs[0]["data"][:] = 2
            assert await asyncio.wait_for(exs[0].start(), 10) == 1  # the root finishes alone
            for r in (1, 2):
                np.testing.assert_array_equal(bufs[r]["data"], -7)
            await asyncio.wait_for(asyncio.gather(exs[1].start(), exs[2].start()), 10)
            for r in (1, 2):
                np.testing.assert_array_equal(bufs[r]["data"], 2)
        finally:
            for ex in exs:
                ex.close()
