"""The single-copy allreduce between the ranks of one host (asynccoll.comm.cma).

Real processes reading each other's memory (process_vm_readv), wake-ups over real tcp
connections. Results are compared bit for bit with the two-shot over shared segments: the
same blocks reduced in the same order must give the same bits.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, needs_cma, spawn_world

import asynccoll
from asynccoll.collectives.shm import SHM_ONE_SHOT_READ
from asynccoll.comm.cma import CMA_MIN_BLOCK, build_cma_allreduce, cma_size, read_remote
from asynccoll.comm.shm import SHM_DIR

pytestmark = [pytest.mark.multiprocess]


def _data(n: int, rank: int, dtype: Any, step: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(1000 * rank + step)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _ours() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"asynccoll-{os.getuid()}-")}


async def _rank_main(rank: int, P: int, port: int, cma: str) -> dict[str, Any]:
    os.environ["ASYNCCOLL_CMA"] = cma if rank == 0 else "1"
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    seen: dict[str, Any] = {"equal": []}
    async with comm:
        # two-shot by size (P times the message at least SHM_ONE_SHOT_READ) and blocks of at
        # least CMA_MIN_BLOCK
        base = -(-max(SHM_ONE_SHOT_READ // P, CMA_MIN_BLOCK * P) // 8) * 8
        for nbytes, dtype, op in ((base, np.float32, "sum"), (base + 4 * 1003, np.float32, "sum"),
                                  (base + 8 * 7, np.int64, "max"),
                                  (base * 2 + 8, np.float64, "min")):
            n = nbytes // np.dtype(dtype).itemsize
            for step in range(3):  # one executor reused, a fresh array each call
                x = _data(n, rank, dtype, step)
                ref = x.copy()
                await comm.allreduce(x, op=op, out=x, timeout=30)
                await comm.allreduce(ref, op=op, algorithm="shm_two_shot", out=ref, timeout=30)
                want = [_data(n, q, dtype, step) for q in range(P)]
                red = {"sum": np.sum, "max": np.max, "min": np.min}[op]
                close = np.allclose(x, red(want, axis=0), rtol=1e-5, atol=1e-4)
                seen["equal"].append(bool(np.array_equal(x, ref)) and close)
        # an array in shared memory (comm.empty) is reduced where it lies instead (each rank
        # pushes its block into every peer's array): the same bits as the single-copy path
        # gives a private copy
        n = (base + 32) // 4
        a = await comm.empty(n, np.float32, timeout=30)
        for step in range(2):
            a[...] = _data(n, rank, np.float32, step)
            ref = a.copy()
            await comm.allreduce(a, out=a, timeout=30)
            await comm.allreduce(ref, out=ref, timeout=30)
            seen["equal"].append(bool(np.array_equal(a, ref)))
        seen["cma"] = len(comm._dense._cma)  # how many single-copy allreduces were set up
        await comm.barrier(timeout=30)
        await asyncio.sleep(0.1)
    return seen


@needs_cma
@pytest.mark.timeout(150)
@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_single_copy_equals_two_shot_bit_for_bit(P: int) -> None:
    before = _ours()
    out = spawn_world(async_child, P, (_rank_main, free_port(), "1"), 120)
    assert all(all(r["equal"]) and len(r["equal"]) == 14 for r in out), out
    # the single-copy path served the four private arrays and the arena's private copy
    assert all(r["cma"] == 5 for r in out), out
    assert _ours() - before == set()


@pytest.mark.timeout(120)
def test_one_rank_with_it_off_turns_it_off_for_all() -> None:
    out = spawn_world(async_child, 3, (_rank_main, free_port(), "0"), 90)
    assert all(all(r["equal"]) for r in out), out
    assert all(r["cma"] == 0 for r in out), out  # every rank took the segments


def test_read_remote_reads_this_process_and_names_what_failed() -> None:
    src = np.arange(1000, dtype=np.int32)
    dst = np.zeros_like(src)
    read_remote(os.getpid(), src.ctypes.data, dst.ctypes.data, src.nbytes)
    assert np.array_equal(src, dst)
    with pytest.raises(OSError, match="process"):
        read_remote(os.getpid(), 8, dst.ctypes.data, 8)  # a bad address: EFAULT
    with pytest.raises(OSError, match="No such process"):
        read_remote(2**22 + 12345, src.ctypes.data, dst.ctypes.data, 8)


def test_schedule_arguments_are_checked_and_blocks_cover_the_vector() -> None:
    with pytest.raises(ValueError, match="op"):
        build_cma_allreduce(0, 4, 100, np.float32, "mean", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="count"):
        build_cma_allreduce(0, 4, 0, np.float32, "sum", [1, 2, 3, 4])
    for P, count in ((4, 3), (5, 1003), (2, 1)):  # fewer elements than ranks: empty blocks
        covered = []
        for r in range(P):
            s = build_cma_allreduce(r, P, count, np.float32, "sum", list(range(100, 100 + P)))
            reduced = [op for op in s.ops if op.kernel == "cma_reduce"]
            others = [q for q in range(P) if q != r]
            if not reduced:  # an empty block: nothing to reduce or write, still two rounds
                assert sum(op.kind == "send" for op in s.ops) == 2 * (P - 1)
                continue
            (red,) = reduced
            assert red.params["peers"] == others
            assert red.params["pids"] == [100 + q for q in others]
            assert sum(op.kind == "send" for op in s.ops) == 2 * (P - 1)  # two rounds
            covered.append((red.output.offset, red.output.count))
        assert sum(n for _, n in covered) == count
        assert sorted(covered) == [(o, n) for o, n in sorted(covered)]
        ends = [o + n for o, n in sorted(covered)]
        assert [o for o, _ in sorted(covered)] == [0, *ends[:-1]]  # contiguous, no overlap


async def _abandon_main(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    got: dict[str, Any] = {}
    async with comm:
        n = -(-max(SHM_ONE_SHOT_READ // P, CMA_MIN_BLOCK * P) // 4)
        x = np.ones(n, np.float32)
        await comm.allreduce(x, out=x, timeout=30)  # set up; every rank on the single-copy path
        got["cma"] = len(comm._dense._cma)
        y = np.ones(n, np.float32)
        if rank == 1:
            await asyncio.sleep(1.5)  # rank 0 gives up meanwhile
        try:
            await comm.allreduce(y, out=y, timeout=0.5 if rank == 0 else 3)
            got["second"] = "completed"
        except asynccoll.CollectiveTimeoutError:
            got["second"] = "timeout"
        # the abandoned array is kept alive: a peer may still read or write it
        got["held"] = any(np.shares_memory(h, y) for h in comm._dense._cma_held)
    return got


@needs_cma
@pytest.mark.timeout(120)
def test_an_abandoned_call_keeps_its_array_and_no_peer_succeeds_on_it() -> None:
    out = spawn_world(async_child, 2, (_abandon_main, free_port()), 90)
    assert [r["cma"] for r in out] == [1, 1], out
    assert out[0]["second"] == "timeout", out
    assert out[0]["held"], out
    # rank 0 never reduced its block: rank 1 cannot complete with rank 0's array half-used
    assert out[1]["second"] == "timeout", out


def test_small_blocks_stay_on_the_segments() -> None:
    """The default takes the single-copy path only from CMA_MIN_BLOCK per block (measured:
    two-shot through segments was faster below; asynccoll.comm.cma)."""
    assert cma_size(CMA_MIN_BLOCK * 4, 4)
    assert not cma_size(CMA_MIN_BLOCK * 4 - 1, 4)
    assert not cma_size(4 << 20, 4)  # 1 MiB blocks
    assert cma_size(16 << 20, 8)  # 2 MiB blocks
