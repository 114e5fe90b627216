"""The Communicator: synchronous collectives over local_world, blocking twins, bad input."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll import (
    Accumulate,
    AsyncCollError,
    BusyError,
    CollectiveTimeoutError,
    Communicator,
    ExecutionError,
    Majority,
    Quorum,
    Solo,
    TransportClosedError,
)
from asynccoll.testing import local_world

REF = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


async def gather(*aws: Any, timeout: float = 10.0) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws), timeout)


def data(P: int, shape: tuple[int, ...], dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(P)
    return [rng.integers(-4, 5, shape).astype(dtype) for _ in range(P)]


TRANSPORTS = ["inproc", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (asynccoll[ucx])"))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
async def test_sync_collectives(transport: str, P: int) -> None:
    async with local_world(P, transport) as comms:
        assert [(c.rank, c.size, c.progress) for c in comms] == [(r, P, "thread")
                                                                 for r in range(P)]
        for op, dtype, shape in [("sum", "float32", (3, 5)), ("max", "int64", (7,)),
                                 ("prod", "float64", (4,)), ("sum", "int32", (0,)),
                                 ("min", "int16", (1000,))]:
            xs = data(P, shape, dtype)
            keep = [x.copy() for x in xs]
            rs = await gather(*(c.allreduce(x, op=op) for c, x in zip(comms, xs, strict=True)))
            ref = keep[0].copy()
            for x in keep[1:]:
                ref = REF[op](ref, x)
            for r, x, k in zip(rs, xs, keep, strict=True):
                assert r.shape == shape
                assert r.dtype == np.dtype(dtype)
                assert np.array_equal(r, ref)
                assert np.array_equal(x, k)  # inputs untouched: results are new arrays
        xs = data(P, (2, 3), "float64")
        root = P - 1
        bs = await gather(*(c.broadcast(x, root=root) for c, x in zip(comms, xs, strict=True)))
        assert all(np.array_equal(b, xs[root]) for b in bs)
        gs = await gather(*(c.allgather(x) for c, x in zip(comms, xs, strict=True)))
        for g in gs:
            assert g.shape == (P, 2, 3)
            assert np.array_equal(g, np.stack(xs))
        xs = data(P, (10,), "int32")
        rs = await gather(*(c.reduce_scatter(x) for c, x in zip(comms, xs, strict=True)))
        total = np.sum(xs, axis=0)
        assert np.array_equal(np.concatenate(rs), total)
        assert [len(r) for r in rs] == [len(b) for b in np.array_split(total, P)]
        await gather(*(c.barrier() for c in comms))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [5, 300_000])  # below and above the small-message copy path
async def test_allreduce_out_in_place_and_into_another_array(n: int) -> None:
    async with local_world(3, "tcp") as comms:
        xs = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(3)]
        ref = sum(x.copy() for x in xs)
        rs = await gather(*(c.allreduce(x, out=x) for c, x in zip(comms, xs, strict=True)))
        for r, x in zip(rs, xs, strict=True):
            assert r is x  # in place: the caller's array is the result, nothing allocated
            assert np.array_equal(x, ref)
        keep = [x.copy() for x in xs]
        outs = [np.empty_like(x) for x in xs]
        rs = await gather(*(c.allreduce(x, out=o)
                            for c, x, o in zip(comms, xs, outs, strict=True)))
        for r, x, o, k in zip(rs, xs, outs, keep, strict=True):
            assert r is o
            assert np.array_equal(o, 3 * ref)
            assert np.array_equal(x, k)  # x untouched when out is another array
        c = comms[0]
        with pytest.raises(ValueError, match="out must have"):
            await c.allreduce(xs[0], out=np.empty(n + 1))
        with pytest.raises(ValueError, match="out must have"):
            await c.allreduce(xs[0], out=np.empty(n, np.float32))
        with pytest.raises(ValueError, match="out must be C-contiguous"):
            await c.allreduce(xs[0], out=np.empty(2 * n)[::2])
        frozen = xs[0].copy()
        frozen.flags.writeable = False  # in place into read-only memory: refused up front
        with pytest.raises(ValueError, match="out must be writable"):
            await c.allreduce(frozen, out=frozen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [5, 300_000])
async def test_broadcast_out_in_place_and_into_another_array(n: int) -> None:
    async with local_world(3, "tcp") as comms:
        xs = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(3)]
        ref = xs[2].copy()
        rs = await gather(*(c.broadcast(x, 2, out=x) for c, x in zip(comms, xs, strict=True)))
        for r, x in zip(rs, xs, strict=True):
            assert r is x  # in place: nothing allocated
            assert np.array_equal(x, ref)
        xs = [np.full(n, r, np.float64) for r in range(3)]
        outs = [np.zeros(n) for _ in range(3)]
        rs = await gather(*(c.broadcast(x, 1, out=o)
                            for c, x, o in zip(comms, xs, outs, strict=True)))
        for r, x, o, rank in zip(rs, xs, outs, range(3), strict=True):
            assert r is o
            assert np.array_equal(o, np.ones(n))
            assert np.array_equal(x, np.full(n, rank))  # x untouched
        c = comms[0]
        with pytest.raises(ValueError, match="out must have"):
            await c.broadcast(xs[0], 0, out=np.empty(n + 1))
        with pytest.raises(TypeError, match="out must be a NumPy array"):
            await c.broadcast(xs[0], 0, out=[0.0] * n)
        with pytest.raises(ValueError, match="out must be C-contiguous"):
            await c.broadcast(xs[0], 0, out=np.empty(2 * n)[::2])
        frozen = xs[0].copy()
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="out must be writable"):
            await c.broadcast(frozen, 0, out=frozen)
        # the communicator goes on after the refusals
        rs = await gather(*(c.broadcast(x, 0) for c, x in zip(comms, xs, strict=True)))
        assert all(np.array_equal(r, xs[0]) for r in rs)


@pytest.mark.timeout(30)
async def test_algorithms_and_reuse() -> None:
    P = 5
    async with local_world(P) as comms:
        for algorithm in (None, "recursive_doubling", "ring", "rabenseifner"):
            for rep in range(3):
                xs = [np.full(1000, r + rep, np.float64) for r in range(P)]
                rs = await gather(*(c.allreduce(x, algorithm=algorithm)
                                    for c, x in zip(comms, xs, strict=True)))
                assert all(np.array_equal(r, np.sum(xs, axis=0)) for r in rs)
        # one committed schedule per distinct (collective, count, dtype, op, algorithm)
        assert len(comms[0]._dense.entries) == 4


@pytest.mark.timeout(30)
async def test_inline_progress() -> None:
    async with local_world(3, progress="inline") as comms:
        rs = await gather(*(c.allreduce(np.full(4, c.rank)) for c in comms))
        assert all((r == 3).all() for r in rs)
        with pytest.raises(RuntimeError, match="progress='thread'"):
            comms[0].blocking.barrier()


@pytest.mark.timeout(30)
def test_blocking_twins() -> None:
    async def make() -> tuple[Any, list[Communicator]]:
        cm = local_world(3)
        return cm, await cm.__aenter__()

    loop = asyncio.new_event_loop()
    try:
        cm, comms = loop.run_until_complete(make())

        def rank_main(c: Communicator) -> tuple[Any, ...]:
            x = np.arange(4.0) * (c.rank + 1)
            s = c.blocking.allreduce(x)
            c.blocking.barrier()
            res = c.blocking.solo_allreduce(x)
            h = c.partial_allreduce(Majority(), like=x, accumulate=Accumulate.SUM, name="blk")
            h.blocking(x, timeout=10)
            fl = h.flush_blocking(timeout=10)
            return s, res, fl

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            out = list(pool.map(rank_main, comms, timeout=20))
        for s, res, _ in out:
            assert np.array_equal(s, np.arange(4.0) * 6)
            assert res.count >= 1
        loop.run_until_complete(cm.__aexit__(None, None, None))
    finally:
        loop.close()


@pytest.mark.timeout(30)
async def test_blocking_close_closes_the_handles_and_is_idempotent() -> None:
    async with local_world(2) as comms:
        c = comms[1]
        h = c.partial_allreduce(Solo(), like=np.zeros(2), name="blk-close")
        # timeout=0: rank 0 closes only at the end of the block, so do not wait for it
        await asyncio.to_thread(c.blocking.close, 0)
        await asyncio.to_thread(c.blocking.close, 0)
        assert c.closed
        with pytest.raises(TransportClosedError):
            await h(np.ones(2))
        with pytest.raises(TransportClosedError):
            await c.barrier()


@pytest.mark.timeout(30)
async def test_bad_arguments() -> None:
    async with local_world(2) as comms:
        c = comms[0]
        for call in (c.allreduce, c.broadcast, c.allgather, c.solo_allreduce):
            with pytest.raises(ValueError, match="x must be in native byte order"):
                await call(np.arange(3, dtype=">f8"))
        with pytest.raises(ValueError, match="x must be C-contiguous"):
            await c.allreduce(np.zeros((4, 4))[:, 0])
        with pytest.raises(TypeError, match="x must be a NumPy"):
            await c.allreduce([1, 2, 3])
        with pytest.raises(ValueError, match="op"):
            await c.allreduce(np.zeros(3), op="mean")
        with pytest.raises(ValueError, match="algorithm"):
            await c.allreduce(np.zeros(3), algorithm="tree")
        with pytest.raises(ValueError, match="root"):
            await c.broadcast(np.zeros(3), root=2)
        with pytest.raises(ValueError, match="kind"):
            c.partial_allreduce("eager", like=np.zeros(3))
        for k in (0, 3, -1):
            with pytest.raises(ValueError, match="quorum"):
                c.partial_allreduce(Quorum(k), like=np.zeros(3))
        with pytest.raises(ValueError, match="quorum"):
            await c.quorum_allreduce(np.zeros(3), 5)
        with pytest.raises(ValueError, match="like"):
            c.partial_allreduce(Solo(), like=np.zeros((3, 3))[:, 1])
        h = c.partial_allreduce(Solo(), like=np.zeros(3), name="h")
        with pytest.raises(ValueError, match="name"):
            c.partial_allreduce(Solo(), like=np.zeros(3), name="h")
        with pytest.raises(ValueError, match="x must have shape"):
            await h(np.zeros(4))
        with pytest.raises(ValueError, match="x must have shape"):
            await h(np.zeros(3, np.float32))
        # the failed calls left nothing behind: a good call still works everywhere
        h1 = comms[1].partial_allreduce(Solo(), like=np.zeros(3), name="h")
        rs = await gather(h(np.ones(3)), h1(np.ones(3)))
        assert sum(r.count for r in rs) >= 2


@pytest.mark.timeout(30)
async def test_mismatched_shapes_and_dtypes_raise() -> None:
    async with local_world(2) as comms:
        for a, b in [(np.zeros(4), np.zeros(5)), (np.zeros(4, np.float32), np.zeros(4, np.int32))]:
            outs = await asyncio.wait_for(asyncio.gather(
                comms[0].allreduce(a, timeout=5), comms[1].allreduce(b, timeout=5),
                return_exceptions=True), 10)
            assert all(isinstance(o, AsyncCollError) for o in outs), outs
            assert any(isinstance(o, ExecutionError) for o in outs), outs
        # partial: different shapes through the shortcuts share an id and fail, not hang
        outs = await asyncio.wait_for(asyncio.gather(
            comms[0].solo_allreduce(np.zeros(4), timeout=5),
            comms[1].solo_allreduce(np.zeros(6), timeout=5), return_exceptions=True), 10)
        assert all(isinstance(o, AsyncCollError) for o in outs), outs
        # partial: same shape, different op or kind: an error on every rank, never a hang
        for kind1, op1 in [("solo", "max"), ("majority", "sum")]:
            h0 = comms[0].partial_allreduce(Solo(), like=np.zeros(4), name=f"{kind1}{op1}")
            h1 = comms[1].partial_allreduce(kind1, like=np.zeros(4), op=op1, name=f"{kind1}{op1}")
            outs = await asyncio.wait_for(asyncio.gather(
                h0(np.zeros(4), timeout=5), h1(np.zeros(4), timeout=5),
                return_exceptions=True), 10)
            assert all(isinstance(o, AsyncCollError) for o in outs), outs
        # same structure, different kind: only the signature tells them apart
        assert all(isinstance(o, ExecutionError) for o in outs), outs
        assert "disagree" in str(outs[0])


@pytest.mark.timeout(30)
async def test_timeouts_name_what_is_awaited() -> None:
    async with local_world(3) as comms:
        with pytest.raises(CollectiveTimeoutError, match="waiting") as ei:
            await comms[0].allreduce(np.zeros(2), timeout=0.2)
        assert ei.value.pending
        h = [c.partial_allreduce(Majority(), like=np.zeros(2), name="m") for c in comms]
        (i,) = asynccoll.collectives.partial.initiators("majority", 0, 3, h[0].seed)
        other = (i + 1) % 3
        with pytest.raises(CollectiveTimeoutError, match=f"initiators \\[{i}\\]") as ei:
            await h[other](np.ones(2), timeout=0.2)
        assert any("activation" in d for _, _, d in ei.value.pending)
        # the timed-out call's data is not lost: it is in the next execution
        rs = await gather(h[i](np.ones(2)), timeout=10)
        assert np.array_equal(rs[0].value, np.full(2, 2.0))


@pytest.mark.timeout(30)
async def test_busy_and_closed() -> None:
    async with local_world(2) as comms:
        h = comms[0].partial_allreduce(Quorum(2), like=np.zeros(2), name="q")
        comms[1].partial_allreduce(Quorum(2), like=np.zeros(2), name="q")
        t = asyncio.ensure_future(h(np.ones(2)))
        await asyncio.sleep(0.05)
        with pytest.raises(BusyError):
            await h(np.ones(2))
        # close(timeout=0): at once, without waiting for rank 1 to close too (which it does
        # only at the end of the block); it cancels the waiting call, never hangs
        await comms[0].close(timeout=0)
        with pytest.raises(TransportClosedError):
            await asyncio.wait_for(t, 5)
        with pytest.raises(TransportClosedError):
            await comms[0].allreduce(np.zeros(2))
        with pytest.raises(TransportClosedError):
            await h(np.ones(2))
        with pytest.raises(TransportClosedError):
            comms[0].partial_allreduce(Solo(), like=np.zeros(2))
        await comms[0].close()  # idempotent
