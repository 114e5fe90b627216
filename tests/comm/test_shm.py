"""The allreduce through shared memory between the ranks of one host (asynccoll.comm.shm).

Real processes, real segments in /dev/shm, wake-ups over real tcp connections.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll
from asynccoll.collectives.shm import SHM_MIN_BYTES, build_hier_allreduce, build_shm_allreduce
from asynccoll.comm.shm import SHM_DIR, Segment
from asynccoll.testing import local_world

pytestmark = [pytest.mark.multiprocess]


def _ours() -> set[str]:
    """This user's segments in /dev/shm."""
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"asynccoll-{os.getuid()}-")}


def _want(n: int, P: int, dtype: Any, op: str) -> np.ndarray[Any, Any]:
    xs = [_data(n, r, dtype) for r in range(P)]
    if op == "sum":
        return np.sum(xs, axis=0, dtype=dtype)
    return np.max(xs, axis=0)


def _data(n: int, rank: int, dtype: Any) -> np.ndarray[Any, Any]:
    return ((np.arange(n) * (rank + 3)) % 17 - rank).astype(dtype)


async def _rank_main(rank: int, P: int, port: int, host: str | None) -> list[Any]:
    if host is not None:
        os.environ["ASYNCCOLL_HOST_ID"] = f"{host}-{rank}"
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    seen: list[Any] = []
    async with comm:
        if host is not None:  # one host per rank: "shm" is refused, the default takes tcp
            x = _data(SHM_MIN_BYTES // 4, rank, np.float32)
            with pytest.raises(ValueError, match="one host"):
                await comm.allreduce(x, algorithm="shm", timeout=30)
            seen.append(np.array_equal(await comm.allreduce(x, timeout=30),
                                       _want(x.size, P, np.float32, "sum")))
            return seen
        for n, dtype, op, algo in ((1, np.float32, "sum", "shm"),
                                   (max(1, P - 1), np.int64, "max", "shm"),
                                   (1001, np.float64, "sum", "shm"),
                                   (SHM_MIN_BYTES // 4 + 3, np.float32, "sum", None)):
            x = _data(n, rank, dtype)
            for _ in range(3):  # both alternating executors, and reuse
                got = await comm.allreduce(x, op=op, algorithm=algo, timeout=30)
                seen.append(bool(np.array_equal(got, _want(n, P, dtype, op))))
            y = x.copy()
            await comm.allreduce(y, op=op, algorithm=algo, timeout=30, out=y)
            seen.append(bool(np.array_equal(y, _want(n, P, dtype, op))))
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.1)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_equals_numpy_across_processes_and_leaves_nothing(P: int) -> None:
    before = _ours()
    out = spawn_world(async_child, P, (_rank_main, free_port(), None), 90)
    assert all(all(r) for r in out), out
    assert _ours() - before == set()


async def _shared_main(rank: int, P: int, port: int) -> list[bool]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    seen: list[bool] = []
    async with comm:
        x = await comm.zeros((3, 1000), np.float64, timeout=30)
        y = await comm.empty(7, np.int32, timeout=30)
        seen.append(x.shape == (3, 1000) and not x.any())
        for step in range(4):
            x[...] = _data(3000, rank + step, np.float64).reshape(3, 1000)
            want = sum(_data(3000, q + step, np.float64) for q in range(P)).reshape(3, 1000)
            await comm.allreduce(x, out=x, timeout=30)
            seen.append(bool(np.array_equal(x, want)))
            y[...] = rank + step
            await comm.allreduce(y, op="max", out=y, timeout=30)
            seen.append(bool((y == P - 1 + step).all()))
        # not in place: a new array, as for any other input
        z = await comm.allreduce(x, timeout=30)
        seen.append(bool(np.array_equal(z, x * P)))
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.1)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_arrays_in_shared_memory_reduce_in_place(P: int) -> None:
    before = _ours()
    out = spawn_world(async_child, P, (_shared_main, free_port()), 90)
    assert all(all(r) for r in out), out
    assert all(len(r) == 10 for r in out)
    assert _ours() - before == set()


async def _hier_main(rank: int, P: int, port: int, hosts: list[int]) -> list[bool]:
    os.environ["ASYNCCOLL_HOST_ID"] = f"host-{hosts[rank]}"
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    seen: list[bool] = []
    async with comm:
        for n, dtype, op, algo in ((1, np.float64, "sum", "hier"),
                                   (max(1, P - 2), np.int64, "max", "hier"),
                                   (SHM_MIN_BYTES // 4 + 1, np.float32, "sum", None)):
            x = _data(n, rank, dtype)
            for _ in range(3):
                got = await comm.allreduce(x, op=op, algorithm=algo, timeout=30)
                seen.append(bool(np.array_equal(got, _want(n, P, dtype, op))))
        # which path the default took: hierarchical, with segments for this host only
        shm = comm._dense._shm
        seen.append(any(key[-1] for key in shm))
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.1)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 1, 1], [0, 1, 1, 2, 2, 2]],
                         ids=["2x2", "1+2", "1+2+3"])
def test_hierarchical_across_hosts_equals_numpy(hosts: list[int]) -> None:
    before = _ours()
    out = spawn_world(async_child, len(hosts), (_hier_main, free_port(), hosts), 100)
    assert all(all(r) for r in out), out
    assert _ours() - before == set()


@pytest.mark.timeout(120)
def test_ranks_on_different_hosts_do_not_use_shared_memory() -> None:
    out = spawn_world(async_child, 2, (_rank_main, free_port(), "host"), 90)
    assert out == [[True], [True]]


@pytest.mark.timeout(60)
async def test_two_jobs_on_one_host_do_not_interfere() -> None:
    async def job(k: int) -> bool:
        async with local_world(2, "tcp", timeout=30) as comms:
            xs = [np.full(5000, 10 * k + r, np.float32) for r in range(2)]
            ok = True
            for _ in range(5):
                got = await asyncio.gather(*(c.allreduce(x, algorithm="shm")
                                             for c, x in zip(comms, xs, strict=True)))
                ok &= all(np.array_equal(g, xs[0] + xs[1]) for g in got)
            return ok

    assert await asyncio.gather(job(1), job(2)) == [True, True]


def test_segments_are_private(tmp_path: Path) -> None:
    path = str(tmp_path / "seg")
    seg = Segment.create(path, 4096)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        Segment.create(path, 4096)
    with pytest.raises(ValueError, match="4096 bytes"):
        Segment.attach(path, 8192)
    peer = Segment.attach(path, 4096)
    a = peer.array(np.uint8, 4096)
    assert not a.flags.writeable  # peers map read-only
    del a
    peer.close()
    # writable where asked (the arrays of comm.empty: peers write their reduced blocks)
    peer = Segment.attach(path, 4096, writable=True)
    a = peer.array(np.uint8, 4096)
    a[:3] = (7, 8, 9)
    assert seg.array(np.uint8, 3).tolist() == [7, 8, 9]  # the owner sees the peer's write
    del a
    peer.close()
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="mode 644"):
        Segment.attach(path, 4096)
    with pytest.raises(PermissionError, match="mode 644"):
        Segment.attach(path, 4096, writable=True)
    os.chmod(path, 0o600)
    if os.geteuid() == 0:  # only root can hand a file to another user
        os.chown(path, 65534, 65534)
        with pytest.raises(PermissionError, match="uid 65534"):
            Segment.attach(path, 4096)
    seg.unlink()
    assert not os.path.exists(path)
    seg.unlink()  # idempotent
    seg.close()


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="op"):
        build_shm_allreduce(0, 2, 4, np.float32, "mean")
    with pytest.raises(ValueError, match="count"):
        build_shm_allreduce(0, 2, 0, np.float32)
    s = build_shm_allreduce(1, 3, 10, np.float32, algorithm="two_shot")
    assert set(s.slots) == {"data", "mine", "peer0", "peer2"}
    # two wake-up messages per peer, nothing else crosses the network
    assert sum(op.kind == "send" for op in s.ops) == 2 * 2


def test_hierarchical_schedule_keeps_non_leaders_on_their_host() -> None:
    groups = [[0, 3], [1, 2, 4]]
    for r in range(5):
        s = build_hier_allreduce(r, 5, 100, np.float32, "sum", groups)
        mine = next(g for g in groups if r in g)
        peers = {op.peer for op in s.ops if op.kind in ("send", "recv")}
        if r in (0, 1):  # leaders: their host and the other leader
            assert peers == (set(mine) | {0, 1}) - {r}
        else:
            assert peers == set(mine) - {r}
    with pytest.raises(ValueError, match="partition"):
        build_hier_allreduce(0, 3, 10, np.float32, "sum", [[0], [1]])


@pytest.mark.timeout(60)
async def test_a_full_dev_shm_falls_back_to_the_network(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A container's small /dev/shm: reserving the pages fails (ENOSPC) instead of a SIGBUS
    # later; the default allreduce then goes over the network, on every rank together.
    import errno
    import logging

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = _ours()
    n = SHM_MIN_BYTES // 4 + 1
    async with local_world(2, "tcp", timeout=30) as comms:
        with pytest.raises(asynccoll.ExecutionError, match=r"shm-size|could not create"):
            await asyncio.gather(*(c.allreduce(np.ones(n, np.float32), algorithm="shm")
                                   for c in comms))
        with caplog.at_level(logging.WARNING, logger="asynccoll.comm"):
            for _ in range(2):
                got = await asyncio.gather(*(c.allreduce(np.full(n, r + 1.0, np.float32))
                                             for r, c in enumerate(comms)))
                assert all(np.array_equal(g, np.full(n, 3.0, np.float32)) for g in got)
        warned = [r for r in caplog.records if "shared memory unavailable" in r.getMessage()]
        assert warned
        assert "--shm-size" in warned[0].getMessage()
    assert _ours() - before == set()


@pytest.mark.timeout(10)
async def test_a_peer_segment_gone_waits_for_the_loss_then_names_the_segment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's segment already unlinked when this rank maps it (the peer's execution failed
    first): the attach kernel leaves its op pending (KernelWaits) so that the loss on its way
    fails the execution; with none within GONE_GRACE, the execution is aborted with an
    ExecutionError naming the missing segment, once, and only that execution."""
    from asynccoll.comm import shm
    from asynccoll.errors import ExecutionError
    from asynccoll.sched.executor import KernelWaits

    monkeypatch.setattr(shm, "GONE_GRACE", 0.05)

    class Ex:  # what attach_or_wait needs of an executor
        def __init__(self) -> None:
            self.execution = 0
            self.aborted: list[BaseException] = []

        def abort(self, exc: BaseException) -> None:
            self.aborted.append(exc)

    segs = shm.PartialSegments(shm.new_token(), 77, 0, 2, 16, np.float32)  # rank 1 made none
    try:
        ex = Ex()
        with pytest.raises(KernelWaits):
            segs.attach_or_wait(ex)
        assert ex.aborted == []  # not at once: the loss may be on its way
        await asyncio.sleep(0.2)
        assert len(ex.aborted) == 1
        assert isinstance(ex.aborted[0], ExecutionError)
        assert segs.path(1, 0) in str(ex.aborted[0])
        later = Ex()
        with pytest.raises(KernelWaits):
            segs.attach_or_wait(later)
        later.execution = 1  # the execution that waited is over: nothing aborted
        await asyncio.sleep(0.2)
        assert later.aborted == []
    finally:
        segs.close()
