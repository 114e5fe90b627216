"""A partial allreduce call's ``out=``: the result lands in the caller's array, and the handle
reuses its own result buffer instead of allocating one per result.

Logic over inproc (controlled arrival orders), then real processes over shared memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate, DataPath, Majority, Solo
from asynccoll.collectives.partial import initiators
from asynccoll.testing import local_world, policy_of


def v(rank: int, step: int = 1) -> np.ndarray[Any, Any]:
    return np.array([10.0 ** rank * step, -(10.0 ** rank) * step, 0.5 * rank])


async def gather(*aws: Any) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws), 10.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["solo", "majority", "quorum"])
async def test_out_receives_the_same_results_and_the_buffer_is_reused(kind: str) -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        quorum = 3 if kind == "quorum" else None
        plain = [c.partial_allreduce(policy_of(kind, quorum), like=v(0), name="plain")
                 for c in comms]
        into = [c.partial_allreduce(policy_of(kind, quorum), like=v(0), name="into")
                for c in comms]
        outs = [np.full(3, np.nan) for _ in range(P)]
        kept: list[list[int]] = [[] for _ in range(P)]
        for step in range(1, 5):
            want = await gather(*(h(v(r, step)) for r, h in enumerate(plain)))
            xs = [v(r, step) for r in range(P)]
            got = await gather(*(h(x, out=o) for h, x, o in zip(into, xs, outs, strict=True)))
            for r in range(P):
                assert got[r].value is outs[r]  # the caller's array, as allreduce's out=
                assert np.array_equal(outs[r], want[r].value)
                assert (got[r].round, got[r].count, got[r].included) == \
                    (want[r].round, want[r].count, want[r].included)
                assert np.array_equal(xs[r], v(r, step))  # x untouched
                # the value that went into out came back for the next result
                spare = into[r]._contribution._spare
                kept[r].append(id(spare) if spare is not None else -1)
        for r in range(P):
            assert -1 not in kept[r][1:], kept[r]
            assert len(set(kept[r][1:])) == 1, kept[r]  # one buffer, reused every time
        for h in (*plain, *into):
            await h.close()


@pytest.mark.timeout(30)
async def test_out_is_checked_and_a_bad_one_changes_nothing() -> None:
    async with local_world(2, progress="inline") as comms:
        hs = [c.partial_allreduce(Solo(), like=v(0)) for c in comms]
        frozen = np.zeros(3)
        frozen.flags.writeable = False
        for bad, err, what in ((np.zeros(4), ValueError, "shape"),
                               (np.zeros(3, np.float32), ValueError, "dtype"),
                               (np.zeros(6)[::2], ValueError, "C-contiguous"),
                               (frozen, ValueError, "writable"),
                               ([0.0, 0.0, 0.0], TypeError, "array")):
            with pytest.raises(err, match=what):
                await hs[0](v(0), out=bad)
        # the handle still works, nothing was contributed by the refused calls
        rs = await gather(*(h(v(r)) for r, h in enumerate(hs)))
        assert all(np.array_equal(res.value, v(0) + v(1)) for res in rs)
        sparse = comms[0].partial_allreduce(Solo(),
                                            like=asynccoll.SparseVector(
            np.array([0], np.int64), np.array([1.0], np.float32), 8),
                                            path=DataPath(density=0.2))
        with pytest.raises(TypeError, match="dense"):
            await sparse(asynccoll.SparseVector(np.array([1], np.int64),
                                                np.array([1.0], np.float32), 8),
                         out=np.zeros(8, np.float32))
        for h in (*hs, sparse):
            await h.close()


@pytest.mark.timeout(30)
async def test_a_cancelled_call_leaves_out_alone_and_loses_nothing() -> None:
    """A call cancelled while it waits never writes its ``out``; its contribution goes into
    the next execution as any late data does (conservation)."""
    async with local_world(2, progress="inline") as comms:
        hs = [c.partial_allreduce(Majority(), like=v(0)) for c in comms]
        first = initiators("majority", 1, 2, hs[0].seed)
        assert 0 not in first or 1 not in first
        waiter = 1 if 0 in first else 0  # not execution 1's initiator: its call must wait
        if waiter == 1:
            hs = hs[::-1]
        out0 = np.zeros(3)
        task = asyncio.ensure_future(hs[0](v(0, 1), out=out0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()  # waits for an initiator that has not called
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert np.array_equal(out0, np.zeros(3))
        outs = [np.zeros(3), np.zeros(3)]
        rs = await gather(*(h(v(r, 2), out=o) for r, (h, o) in enumerate(zip(hs, outs,
                                                                           strict=True))))
        flushed = await gather(*(h.flush() for h in hs))
        for r in range(2):
            assert rs[r].value is outs[r]
        # the cancelled call's data went into the next execution with the others: nothing lost
        want = v(0, 1) + v(0, 2) + v(1, 2)
        for r in range(2):
            assert np.allclose(outs[r], want), (r, outs[r], want)
            assert rs[r].count == 3
        assert all(f.flushed for f in flushed)
        for h in hs:
            await h.close()


@pytest.mark.timeout(30)
async def test_torch_tensor_out_and_average() -> None:
    torch = pytest.importorskip("torch")
    async with local_world(2, progress="inline") as comms:
        hs = [c.partial_allreduce(Solo(), like=torch.zeros(3, dtype=torch.float64), op="avg")
              for c in comms]
        outs = [torch.full((3,), float("nan"), dtype=torch.float64) for _ in range(2)]
        xs = [torch.tensor(v(r)) for r in range(2)]
        rs = await gather(*(h(x, out=o) for h, x, o in zip(hs, xs, outs, strict=True)))
        for res, o in zip(rs, outs, strict=True):
            assert res.value is o
            assert torch.allclose(o, (xs[0] + xs[1]) / res.count)
        for h in hs:
            await h.close()


async def _shm_main(rank: int, P: int, port: int) -> list[bool]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    ok: list[bool] = []
    async with comm:
        n = 1 << 18  # 1 MiB of float32: through shared memory
        # accumulate=True: what each call and the flush return adds up to every execution's
        # sum. Without it a slow rank's call may rightly get only the latest execution's
        # result, which can be an empty one that the other ranks' flush forced (count 0,
        # zeros), so a test of "every result is non-zero" failed about one run in 30.
        h = comm.partial_allreduce(Majority(), like=np.zeros(n, np.float32),
                                   accumulate=Accumulate.SUM, path=DataPath(shm=True))
        out = np.empty(n, np.float32)
        total = np.zeros(n, np.float64)
        for step in range(1, 6):
            x = np.full(n, rank + step, np.float32)
            res = await h(x, timeout=30, out=out)
            ok.append(res.value is out and bool((out == out[0]).all())
                      and (out[0] > 0) == (res.count > 0))
            total += out
        last = await h.flush(timeout=30)
        total += last.value
        # conservation: every rank's data of every step, once, on every rank
        want = sum(r + s for r in range(P) for s in range(1, 6))
        ok.append(last.flushed and bool((total == want).all()))
    return ok


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_out_over_shared_memory_between_processes() -> None:
    out = spawn_world(async_child, 3, (_shm_main, free_port()), 90)
    assert all(all(r) and len(r) == 6 for r in out), out
