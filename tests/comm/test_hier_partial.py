"""The hierarchical partial allreduce (``comm.hier_partial_allreduce``): a host activates as a unit.

Real processes over tcp, "hosts" made with ``ASYNCCOLL_HOST_ID`` (uneven: 1 + 2 + 3 ranks, and
2 + 2). Every partial kind, with ``Accumulate.SUM`` and random per-rank delays: every rank of a
host gets the same result as its leader, bit for bit; contributors are whole hosts; nothing is
lost or counted twice (the sum of everything a rank was given, flush included, equals the sum
of every rank's contributions); the host step goes through shared memory.
"""
from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate, DataPath, Deadline, Majority, Quorum, Solo, TwoChoice

pytestmark = [pytest.mark.multiprocess]

N = 1 << 16  # 256 KiB of float32: the host groups' allreduce takes shared memory
STEPS = 8
KINDS = [Solo(), Majority(), TwoChoice(), Quorum(2), Deadline(bounds=0.005)]


def _x(rank: int, step: int) -> np.ndarray:
    # small integers: every sum is exact in float32, whatever the order
    return np.random.default_rng(100 * rank + step).integers(-8, 9, N).astype(np.float32)


async def _main(rank: int, P: int, port: int, hosts: list[int]) -> dict[str, object]:
    os.environ["ASYNCCOLL_HOST_ID"] = f"host-{hosts[rank]}"
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    out: dict[str, object] = {"comm_hosts": comm.hosts}
    rng = random.Random(rank)
    checks: list[bool] = []
    async with comm:
        # quorum counts hosts: more than there are is refused at creation, on every rank
        try:
            comm.hier_partial_allreduce(Quorum(P), np.zeros(4, np.float32))
            out["quorum refused"] = False
        except ValueError as exc:
            out["quorum refused"] = "quorum" in str(exc)
        for policy in KINDS:
            kind = policy.name
            h = comm.hier_partial_allreduce(policy, np.zeros(N, np.float32),
                                            accumulate=Accumulate.SUM, name=f"hier-{kind}")
            total = np.zeros(N, np.float64)
            seen = []
            for step in range(STEPS):
                await asyncio.sleep(rng.random() * 0.01 * hosts[rank])  # later hosts slower
                res = await h(_x(rank, step), timeout=30)
                total += res.value
                seen.append((res.round, res.included, sorted(res.contributors),
                             float(res.value.sum())))
                mine = set(h.hosts[[rank in g for g in h.hosts].index(True)])
                # the fields name the right hosts: this call's data in value means this
                # host among the contributors; fresh ranks contributed; arrivals are theirs
                checks.append(not res.included or mine <= res.contributors)
                checks.append(res.fresh <= res.contributors)
                checks.append(set(res.arrivals) <= set(res.fresh))
                checks.append((res.lateness is None) == (rank not in res.arrivals))
            res = await h.flush(timeout=30)
            total += res.value
            seen.append((res.round, res.included, sorted(res.contributors),
                         float(res.value.sum())))
            out[kind] = {"total": total.tolist()[:64], "total_sum": float(total.sum()),
                         "seen": seen, "hosts": h.hosts,
                         "flushed": res.flushed, "world": res.world_size}
        # op="min" over floats with -0.0 in them: every rank of every host the same bits (a
        # quorum of every host, so that every rank gets the same execution: under solo a late
        # host may be handed the next, empty one)
        h = comm.hier_partial_allreduce(Quorum(len(comm.hosts)), np.zeros(N, np.float32), op="min",
                                        name="hier-min")
        x = np.where(np.arange(N) % 3 == rank % 3, -0.0, 1.0 + rank).astype(np.float32)
        res = await h(x, timeout=30)
        fl = await h.flush(timeout=30)
        out["min bits"] = [res.round, res.value.tobytes().hex()[:4096],
                           fl.value.tobytes().hex()[:4096]]
        # on a sub-communicator (ranks 1..P-1): hosts in its own ranks, conservation
        sub = await comm.group(list(range(1, P)), timeout=30)
        if sub is not None:
            h = sub.hier_partial_allreduce(Solo(), np.zeros(8, np.float32),
                                           accumulate=Accumulate.SUM, name="hier-sub")
            got = np.zeros(8, np.float64)
            for step in range(3):
                got += (await h(np.full(8, rank + step, np.float32), timeout=30)).value
            got += (await h.flush(timeout=30)).value
            out["sub"] = [got.tolist(), h.hosts, sub.hosts]
        out["checks"] = checks
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.1)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts", [[0, 1, 1, 2, 2, 2], [0, 0, 1, 1]], ids=["1+2+3", "2x2"])
def test_every_kind_across_uneven_hosts(hosts: list[int]) -> None:
    P = len(hosts)
    out = spawn_world(async_child, P, (_main, free_port(), hosts), 220)
    groups = sorted({tuple(r for r in range(P) if hosts[r] == h) for h in set(hosts)})
    want = np.sum([_x(r, s) for r in range(P) for s in range(STEPS)], axis=0, dtype=np.float64)
    for r in range(P):  # the communicator's own view of the topology
        assert sorted(map(tuple, out[r]["comm_hosts"])) == groups, out[r]["comm_hosts"]
        assert [g[0] for g in out[r]["comm_hosts"]] == sorted(g[0] for g in groups)
    for kind in (p.name for p in KINDS):
        for r in range(P):
            got = out[r][kind]
            assert sorted(map(tuple, got["hosts"])) == groups, (kind, r, got["hosts"])
            # conservation: all given to this rank over the run, flush included
            assert np.array_equal(np.array(got["total"]), want[:64]), (kind, r)
            assert got["total_sum"] == float(want.sum()), (kind, r)
            assert got["flushed"]
            assert got["world"] == P
            for _round, _included, contributors, _ in got["seen"]:
                # contributors are whole hosts
                assert all(set(g) <= set(contributors) or not set(g) & set(contributors)
                           for g in groups), (kind, r, contributors)
        # every rank of a host gets what its leader got, call by call (the same bits)
        for g in groups:
            for r in g[1:]:
                assert out[r][kind]["seen"] == out[g[0]][kind]["seen"], (kind, g, r)
    for r in range(P):
        assert out[r]["quorum refused"], r
        assert all(out[r]["checks"]), r
        assert out[r]["min bits"] == out[0]["min bits"], r  # -0.0 kept, on every host
    # every element has a rank with -0.0 there, so the minimum is -0.0 throughout (float32
    # -0.0 is 00000080 little-endian; +0.0 would be 00000000)
    assert out[0]["min bits"][1] == "00000080" * 512
    # the sub-communicator: its own ranks, every contribution once
    sub_hosts = [[q - 1 for q in g if q > 0] for g in groups]
    sub_hosts = sorted(g for g in sub_hosts if g)
    want_sub = sum(r + step for r in range(1, P) for step in range(3))
    for r in range(1, P):
        got, h_hosts, s_hosts = out[r]["sub"]
        assert sorted(h_hosts) == sub_hosts == sorted(s_hosts), (r, h_hosts, s_hosts)
        assert got == [want_sub] * 8, (r, got)
    # the hosts did not all wait for each other (the later hosts sleep longer before calls)
    assert any(len(c) < P for p in KINDS for _r, _i, c, _s in out[0][p.name]["seen"])


@pytest.mark.timeout(30)
async def test_options_it_does_not_offer_are_refused_by_name() -> None:
    from asynccoll.testing import local_world

    like = np.zeros(8, np.float32)
    async with local_world(2, "inproc", timeout=10) as comms:
        comm = comms[0]
        for kw, said in (({"op": "avg"}, "op='avg'"), ({"accumulate": "mean"}, "accumulate")):
            with pytest.raises(ValueError, match=said):
                comm.hier_partial_allreduce("solo", like, **kw)
        # survive counts a lost leader's host sums again as sums: op="sum" only
        with pytest.raises(ValueError, match="survive with op='min'"):
            comm.hier_partial_allreduce("solo", like, op="min", survive=True)
        # (no path= on the hierarchical handle: Python's TypeError names it)
        with pytest.raises(TypeError, match="path"):
            comm.hier_partial_allreduce("solo", like, path=DataPath(shm=True))
        comm.hier_partial_allreduce(Solo(), like, name="a")
        with pytest.raises(ValueError, match="already used"):
            comm.partial_allreduce(Solo(), like, name="a")
        h = comm.hier_partial_allreduce(Solo(), like)
        with pytest.raises(ValueError, match="shape"):
            await h(np.zeros(9, np.float32))
        # one call at a time per handle, as the flat handle's
        h1 = comm.hier_partial_allreduce(Solo(), like, name="busy")
        first = asyncio.ensure_future(h1(like, timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(asynccoll.BusyError):
            await h1(like, timeout=5)
        first.cancel()
        # seed and quorum are checked before anything else
        with pytest.raises(ValueError, match="seed"):
            comm.hier_partial_allreduce(Majority(seed=-1), like)
        with pytest.raises(TypeError, match="quorum"):  # (a keyword that is gone)
            comm.hier_partial_allreduce("solo", like, quorum=1)
