"""The partial collectives with their data phase through shared memory (asynccoll.comm.shm,
``PartialSegments``): every kind equals the NumPy reference, counts every contribution once
(``Accumulate.SUM``) and leaves the replicas equal; nothing is left in /dev/shm.

Real processes over tcp for P = 2..8; in-process worlds (one process mapping every rank's
segments) for the schedule's corner cases.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll import Accumulate, DataPath, Deadline, Quorum, Solo
from asynccoll.collectives.shm import build_shm_partial_allreduce
from asynccoll.comm.shm import SHM_DIR, job_prefix, job_tag
from asynccoll.testing import local_world, policy_of

pytestmark = [pytest.mark.multiprocess]

#: (kind, quorum as a function of P) of every partial kind
KINDS = [("solo", None), ("majority", None), ("two_choice", None), ("quorum", "half"),
         ("deadline", "half")]


def _left(token: int) -> list[str]:
    prefix = job_prefix(job_tag(token))
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def _fix_token(token: int) -> None:
    from asynccoll.comm import dense

    dense.new_token = lambda: token  # type: ignore[attr-defined]


def _quorum(q: str | None, P: int) -> int | None:
    return None if q is None else max(1, (P + 1) // 2)


def _x(n: int, rank: int, t: int) -> np.ndarray[Any, Any]:
    x = (np.arange(n, dtype=np.int64) % 7) * (rank + 1) + t
    x[0] = 10**rank * (t + 1)  # element 0 tells who contributed what
    x[1] = 1  # element 1 counts contributions
    return x


async def _kinds_main(rank: int, P: int, port: int, token: int, T: int) -> dict[str, Any]:
    _fix_token(token)
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60, collective_timeout=30)
    rng = random.Random(rank)
    out: dict[str, Any] = {}
    async with comm:
        for i, (kind, q) in enumerate(KINDS):
            algo = ("one_shot", "two_shot")[i % 2]
            n = 1003 if i % 2 else 5  # sizes with fewer elements than ranks too
            policy = (Deadline(quorum=_quorum(q, P), bounds=0.05) if kind == "deadline"
                      else policy_of(kind, _quorum(q, P)))
            h = comm.partial_allreduce(policy, like=np.zeros(n, np.int64),
                                       accumulate=Accumulate.SUM, name=f"shm-{kind}",
                                       path=DataPath(shm=algo))
            assert h._segments is not None, "not through shared memory"
            got = []
            for t in range(T):
                await asyncio.sleep(rng.uniform(0, 0.003))
                got.append(await h(_x(n, rank, t), timeout=30))
            got.append(await h.flush(timeout=30))
            # accumulating, the running sum after round e is the sum of rounds 0..e: the
            # same on every rank (the replicas of plain SGD stay equal)
            running = np.cumsum([g.value for g in got], axis=0)
            out[kind] = {"total": running[-1].tolist(), "count": sum(g.count for g in got),
                         "rounds": [(g.round, v.tolist()) for g, v in zip(got, running,
                                                                           strict=True)]}
        # a float32 handle (meta packed) and an int16 one (meta over the network), in place
        for dtype in (np.float32, np.int16):
            h = comm.partial_allreduce(Solo(), like=np.zeros(300_000, dtype),
                                       accumulate=Accumulate.SUM, name=f"shm-{dtype.__name__}",
                                       path=DataPath(shm=True))
            acc = np.zeros(300_000, np.float64)
            for t in range(3):
                acc += (await h(np.full(300_000, rank + t, dtype), timeout=30)).value
            acc += (await h.flush(timeout=30)).value
            out[np.dtype(dtype).name] = float(acc[0]), float(acc[-1])
        # chosen by default at this size, with every rank on this host
        h = comm.partial_allreduce(Solo(), like=np.zeros(1 << 16, np.float32), name="auto")
        out["auto"] = h._segments is not None
        await h.flush(timeout=30)
        await comm.barrier(timeout=30)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [2, 3, 4, 5, 6, 7, 8])
def test_every_kind_through_shared_memory_across_processes(P: int) -> None:
    T = 6
    token = secrets.randbits(62)
    try:
        out = spawn_world(async_child, P, (_kinds_main, free_port(), token, T), 250)
        for kind, _ in KINDS:
            n = 1003 if [k for k, _ in KINDS].index(kind) % 2 else 5
            want = np.sum([_x(n, r, t) for r in range(P) for t in range(T)], axis=0)
            for r in range(P):
                assert out[r][kind]["total"] == want.tolist(), (kind, r)
                assert out[r][kind]["count"] == P * T, (kind, r)
            # replicas: every rank's running sum after a round is the same
            seen: dict[int, list[int]] = {}
            for r in range(P):
                for rnd, v in out[r][kind]["rounds"]:
                    assert seen.setdefault(rnd, v) == v, (kind, r, rnd)
        for dt in ("float32", "int16"):
            s = sum(rank + t for rank in range(P) for t in range(3))
            assert all(o[dt] == (s, s) for o in out), (dt, [o[dt] for o in out])
        assert all(o["auto"] for o in out)
        assert _left(token) == []
    finally:
        for name in _left(token):
            os.unlink(os.path.join(SHM_DIR, name))


# -- in one process: corner cases of the schedule ---------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [1, 2, 3, 6])
async def test_in_process_world_every_kind(P: int) -> None:
    async with local_world(P) as comms:
        await asyncio.gather(*(c.sync_clocks() for c in comms))
        for kind, q in KINDS:
            hs = [c.partial_allreduce(policy_of(kind, _quorum(q, P)),
                                      like=np.zeros(P + 1, np.int64), accumulate=Accumulate.SUM,
                                      path=DataPath(shm=True)) for c in comms]
            assert all(h._segments is not None for h in hs)

            async def rank_main(r: int, h: Any) -> list[Any]:
                got = [await h(_x(P + 1, r, t), timeout=10) for t in range(4)]
                return [*got, await h.flush(timeout=10)]

            out = await asyncio.wait_for(asyncio.gather(
                *(rank_main(r, h) for r, h in enumerate(hs))), 30)
            want = np.sum([_x(P + 1, r, t) for r in range(P) for t in range(4)], axis=0)
            for got in out:
                assert np.array_equal(np.sum([g.value for g in got], axis=0), want), kind


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("shm", "path"), [(True, "through shared memory"),
                                           (False, "over the network")])
async def test_a_first_execution_that_times_out_says_to_create_handles_alike(
        shm: bool, path: str) -> None:
    # (ranks that created a handle differently fail at its first execution, with an
    # ExecutionError where a message does not fit, or time out; here rank 1 has no handle)
    async with local_world(2, progress="inline", timeout=5) as comms:
        await asyncio.gather(*(c.sync_clocks() for c in comms))
        h = comms[0].partial_allreduce(Quorum(2), like=np.zeros(8), name="m",
                                       path=DataPath(shm=shm))
        with pytest.raises(asynccoll.CollectiveTimeoutError) as info:
            await h(np.ones(8), timeout=0.5)
        assert "the first execution of 'm': every rank must create the handle alike" in \
            str(info.value)
        assert f"this rank's data goes {path}" in str(info.value)


def test_the_data_round_activates() -> None:
    # no activation broadcast: the "written" messages of the data phase activate a rank
    for P in (2, 3, 4):
        for r in range(P):
            s = build_shm_partial_allreduce(r, P, 10, np.float32, kind="majority")
            assert not [op for op in s.ops if op.msg == "activation" and op.kind == "send"]
            act = next(i for i, op in enumerate(s.ops) if op.label == "activated")
            trig = [s.ops[d] for d in s.ops[act].deps]
            assert sum(op.kind == "recv" and op.msg == "data" for op in trig) == P - 1


@pytest.mark.timeout(60)
async def test_shm_arguments_are_checked() -> None:
    async with local_world(2) as comms:
        x = np.zeros(8, np.float32)
        with pytest.raises(ValueError, match="host layout is not known"):
            comms[0].partial_allreduce(Solo(), like=x, path=DataPath(shm=True))
        with pytest.raises(ValueError, match="shm=False"):
            comms[0].partial_allreduce(Solo(), like=x, path=DataPath(algorithm="shm", shm=False))
        await asyncio.gather(*(c.sync_clocks() for c in comms))
        h = comms[0].partial_allreduce(Solo(), like=x)
        assert h._segments is None  # 32 bytes: the network's
        sv = asynccoll.SparseVector(np.array([0]), np.array([1.0], np.float32), 8)
        # sparse handles: through shared memory with the split algorithms only
        with pytest.raises(ValueError, match="split algorithms"):
            comms[0].partial_allreduce(Solo(), like=sv,
                                       path=DataPath(algorithm='ssar_recursive_double', shm=True))
        with pytest.raises(ValueError, match="shm must be True, False or None"):
            comms[0].partial_allreduce(Solo(), like=sv, path=DataPath(shm="yes"))
        assert comms[0].partial_allreduce(Solo(), like=sv, name="sparse-net",
                                          path=DataPath(shm=False))._segments is None
        assert comms[0].partial_allreduce(Solo(), like=sv, name="sparse-net-np",
                                          path=DataPath(shm=np.False_))._segments is None
        # at P = 2 the chooser prefers recursive doubling; shm=True takes the split allgather
        h = comms[0].partial_allreduce(Solo(), like=sv, name="sp-shm",
                                       path=DataPath(shm=True, density=0.1))
        assert h._segments is not None
        assert h._ex.schedule.name == "sparse_partial_allreduce.solo.shm"


@pytest.mark.timeout(60)
async def test_groups_on_one_host_name_their_segments_apart() -> None:
    # two groups, each with a handle of the same (default) name: same schedule id, same group
    # ranks, so only the group's own token keeps their segments apart
    async with local_world(4) as comms:
        await asyncio.gather(*(c.sync_clocks() for c in comms))
        groups = await asyncio.gather(*(c.split(c.rank % 2) for c in comms))
        hs = [g.partial_allreduce(Solo(), like=np.zeros(3, np.int64), accumulate=Accumulate.SUM,
                                  path=DataPath(shm=True)) for g in groups]

        async def rank_main(r: int, h: Any) -> int:
            first = await h(np.full(3, r, np.int64), timeout=10)
            return int(first.value[0] + (await h.flush(timeout=10)).value[0])

        got = await asyncio.wait_for(asyncio.gather(
            *(rank_main(r, h) for r, h in enumerate(hs))), 30)
        assert got == [0 + 2, 1 + 3, 0 + 2, 1 + 3]


def test_partial_segments_are_private_and_named_per_job() -> None:
    from asynccoll.comm.shm import PartialSegments

    token, sid = secrets.randbits(62), 12345
    mine = PartialSegments(token, sid, 0, 2, 10, np.float32)
    try:
        # the peer's names, taken by a file others may read: refused, nothing mapped from it
        for part in (0, 1):
            path = mine.path(1, part)
            with open(path, "wb") as f:
                f.truncate(40)
            os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="refusing"):
            mine.attach()
        for part in (0, 1):
            os.unlink(mine.path(1, part))
        # this rank's own names already taken (another handle, another job's same token):
        # creation fails instead of sharing
        with pytest.raises(FileExistsError):
            PartialSegments(token, sid, 0, 2, 10, np.float32)
        # a peer of the right size and mode is mapped, read-only, and bound by part
        peer = PartialSegments(token, sid, 1, 2, 10, np.float32)
        try:
            assert mine.attach()
            assert not mine.attach()  # nothing left to map
            peer.buffers(1)["mine"][:] = 7
            got = mine.buffers(1)["peer1"]
            assert not got.flags.writeable
            assert (got == 7).all()
            assert not mine.buffers(0)["peer1"].any()
            mine.forget(1)  # a lost peer's, by name
            assert not os.path.exists(peer.path(1, 0))
        finally:
            peer.close()
    finally:
        mine.close()
    assert _left(token) == []
