"""Sub-communicators (``comm.split``, ``comm.group``): every collective and partial kind on
groups of every shape, NumPy-exact, over the in-process fabric and real loopback sockets;
overlapping groups at once; bad arguments; groups by host across real processes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate
from asynccoll.comm.groups import GROUP_SPACE, GroupTransport
from asynccoll.testing import local_world, policy_of

TRANSPORTS = ["inproc", "tcp"]
PARTIAL = [("solo", None), ("majority", None), ("two_choice", None), ("quorum", 1),
           ("deadline", None)]


async def _every_collective(g: asynccoll.Communicator, members: list[int],
                            parent_rank: int) -> None:
    """Run every synchronous collective and partial kind on ``g`` and check it against
    NumPy: rank r of the parent contributes ``(r + 1) * arange``."""
    n = 12
    base = np.arange(n, dtype=np.float64)
    x = base * (parent_rank + 1)
    total = base * sum(m + 1 for m in members)
    assert np.array_equal(await g.allreduce(x), total)
    assert np.array_equal(await g.allreduce(x, op="max"), base * (max(members) + 1))
    root = g.size - 1
    assert np.array_equal(await g.broadcast(x, root=root), base * (members[root] + 1))
    got = await g.allgather(x)
    assert np.array_equal(got, np.stack([base * (m + 1) for m in members]))
    blocks = np.array_split(total, g.size)
    assert np.array_equal(await g.reduce_scatter(x), blocks[g.rank])
    await g.barrier()
    sparse = np.zeros(n)
    sparse[parent_rank % n] = 1.0
    res = await g.sparse_allreduce(sparse, density=1 / n)
    dense = res.to_dense() if isinstance(res, asynccoll.SparseVector) else res
    want = np.zeros(n)
    for m in members:
        want[m % n] += 1.0
    assert np.array_equal(np.asarray(dense).reshape(-1), want)
    for kind, q in PARTIAL:
        h = g.partial_allreduce(policy_of(kind, None if q is None else min(q, g.size)), like=x,
                                accumulate=Accumulate.SUM)
        acc = np.zeros(n)
        count = 0
        for step in range(4):
            await asyncio.sleep(0.001 * g.rank * step)
            r = await h(x)
            acc += r.value
            count += r.count
        f = await h.flush()
        acc += f.value
        count += f.count
        # conservation: every contribution of every member counted exactly once
        assert np.array_equal(acc, 4 * total), (kind, acc, 4 * total)
        assert count == 4 * g.size, (kind, count)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_split_by_parity_runs_every_collective(transport: str) -> None:
    async with local_world(4, transport, timeout=30) as comms:
        async def one(c: asynccoll.Communicator) -> tuple[int, int, tuple[int, ...]]:
            g = await c.split(c.rank % 2)
            assert g is not None
            members = [r for r in range(4) if r % 2 == c.rank % 2]
            await _every_collective(g, members, c.rank)
            # the parent still works beside its groups
            assert (await c.allreduce(np.ones(2)))[0] == 4
            return g.rank, g.size, g.members
        out = await asyncio.gather(*(one(c) for c in comms))
    assert out == [(0, 2, (0, 2)), (0, 2, (1, 3)), (1, 2, (0, 2)), (1, 2, (1, 3))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_key_orders_the_ranks_and_none_stays_out(transport: str) -> None:
    async with local_world(4, transport, timeout=30) as comms:
        async def one(c: asynccoll.Communicator) -> Any:
            # rank 0 stays out; the others are ranked in reverse order by key
            g = await c.split(None if c.rank == 0 else 7, key=-c.rank)
            if g is None:
                return None
            await _every_collective(g, [3, 2, 1], c.rank)
            return g.rank, g.members
        out = await asyncio.gather(*(one(c) for c in comms))
    assert out == [None, (2, (3, 2, 1)), (1, (3, 2, 1)), (0, (3, 2, 1))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_single_rank_group(transport: str) -> None:
    async with local_world(3, transport, timeout=30) as comms:
        async def one(c: asynccoll.Communicator) -> Any:
            g = await c.group([1])
            if g is None:
                return None
            await _every_collective(g, [1], c.rank)
            return g.rank, g.size
        assert await asyncio.gather(*(one(c) for c in comms)) == [None, (0, 1), None]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_overlapping_groups_run_at_once(transport: str) -> None:
    """Groups {0,1,2} and {1,2,3} share ranks 1 and 2, which run both groups' collectives
    concurrently, with a nested group of the first, while the parent runs its own."""
    async with local_world(4, transport, timeout=30) as comms:
        async def one(c: asynccoll.Communicator) -> None:
            a = await c.group([0, 1, 2])
            b = await c.group([1, 2, 3])
            jobs = []
            if a is not None:
                jobs.append(_every_collective(a, [0, 1, 2], c.rank))
            if b is not None:
                jobs.append(_every_collective(b, [1, 2, 3], c.rank))
            jobs.append(c.allreduce(np.ones(3)))
            await asyncio.gather(*jobs)
            if a is not None:
                # a group of a group: its members named in the job's ranks
                inner = await a.split(a.rank // 2)
                assert inner is not None
                assert inner.members == ((0, 1) if c.rank < 2 else (2,))
                await _every_collective(inner, list(inner.members), c.rank)
        await asyncio.gather(*(one(c) for c in comms))


@pytest.mark.timeout(60)
async def test_groups_share_the_parents_connections() -> None:
    async with local_world(4, "tcp", timeout=30) as comms:
        conns = [len(c.transport._conns) for c in comms]  # type: ignore[attr-defined]
        gs = await asyncio.gather(*(c.split(0) for c in comms))
        assert all(isinstance(g.transport, GroupTransport) for g in gs if g)
        assert [len(c.transport._conns) for c in comms] == conns  # type: ignore[attr-defined]
        t = gs[0].transport  # type: ignore[union-attr]
        # its schedule ids live in their own space, apart from the parent's and other groups'
        assert all(t.sched_id(s) >> 60 == GROUP_SPACE >> 60 for s in (1, 2, 1 << 62))
        assert t.sched_id(1) != t.sched_id(2)
        await asyncio.gather(*(g.close() for g in gs if g))
        # a closed group leaves its parent working
        assert all((await asyncio.gather(*(c.allreduce(np.ones(1)) for c in comms)))[0] == 4)


@pytest.mark.timeout(60)
async def test_bad_arguments_name_what_was_wrong() -> None:
    async with local_world(2, "inproc", timeout=10) as comms:
        c = comms[0]
        with pytest.raises(ValueError, match="color"):
            await c.split(-1)
        with pytest.raises(ValueError, match="color"):
            await c.split("rack")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key"):
            await c.split(0, key="a")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="ranks"):
            await c.group([0, 0])
        with pytest.raises(ValueError, match="ranks"):
            await c.group([5])
        with pytest.raises(ValueError, match="ranks"):
            await c.group([])
        with pytest.raises(TypeError, match="ranks"):
            await c.group([True])
        # ranks that disagree on the group all get a ValueError, and the runtime goes on
        res = await asyncio.gather(comms[0].group([0, 1]), comms[1].group([1, 0]),
                                   return_exceptions=True)
        assert all(isinstance(r, ValueError) and "differ" in str(r) for r in res), res
        out = await asyncio.gather(*(x.allreduce(np.ones(1)) for x in comms))
        assert out[0][0] == 2


async def _by_host(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    async with comm:
        g = await comm.split("host")
        assert g is not None
        x = np.full(1 << 17, rank + 1.0, np.float32)  # 512 KiB: the shared-memory path
        s = await g.allreduce(x)
        await g.close()
        return {"members": g.members, "sum": float(s[0]), "uniform": bool((s == s[0]).all())}


def _by_host_child(rank: int, P: int, *rest: Any) -> None:
    import os
    os.environ["ASYNCCOLL_HOST_ID"] = f"host{[0, 0, 1, 1, 1][rank]}"
    async_child(rank, P, _by_host, *rest)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_split_by_host_across_processes() -> None:
    out = spawn_world(_by_host_child, 5, (free_port(),))
    assert [o["members"] for o in out] == [(0, 1), (0, 1), (2, 3, 4), (2, 3, 4), (2, 3, 4)]
    assert [o["sum"] for o in out] == [3.0, 3.0, 12.0, 12.0, 12.0]
    assert all(o["uniform"] for o in out)
