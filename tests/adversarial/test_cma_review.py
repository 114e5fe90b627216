"""The single-copy allreduce (asynccoll.comm.cma) reviewed as an adversary and as a user would
use it: calls of every dtype and odd size, arrays that are slices of larger ones, ``out=``,
torch tensors, concurrent calls (coroutines and threads), groups whose ranks are not the
job's, a cancelled call or probe, a rank that gave up and closed while a slow peer still
reduces, and the probe refused or learned late by some ranks.

Real processes over loopback tcp. Two-shot by size (so single-copy where the ranks may read
each other's memory) needs P times the message to reach SHM_ONE_SHOT_READ (16 MiB) and
blocks of at least CMA_MIN_BLOCK (2 MiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import traceback
from functools import partial
from typing import Any

import numpy as np
import pytest
from _helpers import SECRET, async_child, free_port, needs_cma, spawn_world

import asynccoll
from asynccoll.collectives.shm import SHM_ONE_SHOT_READ
from asynccoll.comm.cma import CMA_MIN_BLOCK
from asynccoll.comm.shm import SHM_DIR

pytestmark = [pytest.mark.multiprocess]

_PERIOD = 4099
TIMEOUT = 6  # seconds each call may take here (a hang shows as a timeout)




def _ours() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"asynccoll-{os.getuid()}-")}


def _two_shot_count(P: int, dtype: Any, extra: int = 0) -> int:
    """Elements of ``dtype`` that make a single-copy allreduce at P (plus ``extra``): two-shot
    by size, and blocks of at least CMA_MIN_BLOCK."""
    item = np.dtype(dtype).itemsize
    nbytes = max(-(-SHM_ONE_SHOT_READ // P), CMA_MIN_BLOCK * P)
    return int(-(-nbytes // item) + extra)


def _data(n: int, rank: int, dtype: Any, step: int = 0) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s vector of step ``step``: integers in [-100, 100] (quarters in a float, so
    float sums are exact; a bool is true for about 3 in 10), distinct per rank and step, with a
    period of 4099 elements (a prime: no block boundary of the allreduce falls on it). Tiled
    from one period, not drawn from a random generator: the references below build P of these
    at up to 12 MiB each, and drawing them made this the suite's slowest test (55 s in CI)."""
    dt = np.dtype(dtype)
    k = (np.arange(_PERIOD, dtype=np.int64) * 40503 + 7919 * rank + 104729 * step) % 201
    if dt.kind == "b":
        period = k % 10 < 3
    elif dt.kind == "f":
        period = ((k - 100) / 4).astype(dt)
    else:
        period = (k - 100).astype(dt)
    return np.resize(period, n)


async def _connect(rank: int, P: int, port: int) -> asynccoll.Communicator:
    return await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)


# -- the probe learned late by some ranks ----------------------------------------------------
async def _late_main(rank: int, P: int, port: int, cma: str) -> dict[str, Any]:
    os.environ["ASYNCCOLL_CMA"] = cma if rank == 0 else "1"
    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {}
    async with comm:
        na, nb = _two_shot_count(P, np.float32), _two_shot_count(P, np.float32, 1001)
        a, b = _data(na, rank, np.float32), _data(nb, rank, np.float32, 1)
        try:
            if rank == 0:  # both at once: the second is made while the first still probes
                await asyncio.gather(comm.allreduce(a, out=a, timeout=TIMEOUT),
                                     comm.allreduce(b, out=b, timeout=TIMEOUT))
            else:  # the same calls in the same order, the second once the first is done
                await comm.allreduce(a, out=a, timeout=TIMEOUT)
                await asyncio.sleep(0.3)
                await comm.allreduce(b, out=b, timeout=TIMEOUT)
            await comm.barrier(timeout=TIMEOUT)  # the ranks still agree on the ids that follow
            got["ok"] = True
        except Exception as exc:
            got["ok"] = f"{type(exc).__name__}: {exc}"
        got["right"] = bool(
            np.allclose(a, sum(_data(na, q, np.float32) for q in range(P)), atol=1e-4)
            and np.allclose(b, sum(_data(nb, q, np.float32, 1) for q in range(P)), atol=1e-4))
        got["cma"] = len(comm._dense._cma)
        await comm.close(timeout=0 if got["ok"] is not True else None)
    return got


@needs_cma
@pytest.mark.timeout(60)
def test_a_call_made_while_the_probe_runs_on_one_rank_only_does_not_probe_again() -> None:
    """Rank 0 makes its second (other-size) call while its first still probes; rank 1 makes
    it after the probe: both must take it without a probe of their own (one probe, however
    many callers, as the host layout is learned once)."""
    out = spawn_world(async_child, 2, (_late_main, free_port(), "1"), 50)
    assert all(r["ok"] is True for r in out), out
    assert all(r["right"] for r in out), out
    assert all(r["cma"] == 2 for r in out), out  # both on the single-copy path


@pytest.mark.timeout(60)
def test_refused_probe_learned_late_keeps_the_schedule_ids_in_step() -> None:
    """The same with the single-copy path off on rank 0: every rank falls back to the
    segments, and the ids every rank takes must stay in step whether its second call came
    while the probe ran or after it (the segments' names, the barrier that follows)."""
    before = _ours()
    out = spawn_world(async_child, 2, (_late_main, free_port(), "0"), 50)
    assert all(r["ok"] is True for r in out), out
    assert all(r["right"] for r in out), out
    assert all(r["cma"] == 0 for r in out), out
    assert _ours() - before == set()


# -- dtypes, odd sizes, slices, out=, torch, concurrent calls ---------------------------------
_RED = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _want(n: int, P: int, dtype: Any, op: str, step: int) -> np.ndarray[Any, Any]:
    """Every rank's vector reduced in rank order (exact for integers and bools)."""
    dt = np.dtype(dtype)
    fn = _RED[op]
    if dt.kind == "b":
        fn = np.logical_or if op in ("sum", "max") else np.logical_and
    acc = _data(n, 0, dt, step)
    for q in range(1, P):
        acc = fn(acc, _data(n, q, dt, step)).astype(dt)
    return acc


async def _mixed_main(rank: int, P: int, port: int, with_torch: bool) -> dict[str, Any]:
    comm = await _connect(rank, P, port)
    bad: list[str] = []
    digests: dict[str, str] = {}

    def check(name: str, got: Any, want: Any) -> None:
        """``want``: an array, or a reference to build (a reduced result: built and compared on
        rank 0 only, every rank's bytes compared with rank 0's by digest in the test)."""
        got = np.asarray(got)
        if callable(want):
            digests[name] = hashlib.sha1(np.ascontiguousarray(got).tobytes()).hexdigest()
            if rank != 0:
                return
            want = want()
        same = np.array_equal(got, want) if got.dtype.kind in "biu" else \
            np.allclose(got, want, rtol=1e-2 if got.dtype == np.float16 else 1e-5, atol=1e-3)
        if not same:
            bad.append(name)

    async def bits(name: str, got: Any, x: Any, op: str) -> None:
        """``got`` bit for bit the two-shot over segments' result of ``x`` (the same blocks
        reduced in the same order)."""
        ref = np.array(x, copy=True)
        await comm.allreduce(ref, op=op, algorithm="shm_two_shot", out=ref, timeout=TIMEOUT)
        if not np.array_equal(np.asarray(got).reshape(-1), ref.reshape(-1)):
            bad.append(f"{name} bits")

    async with comm:
        cases = [(np.bool_, "sum", 5), (np.bool_, "min", 0), (np.int8, "sum", 7),
                 (np.float16, "max", 1), (np.float64, "sum", 13), (np.int64, "prod", 2),
                 (np.float32, "min", P + 1)]
        for i, (dt, op, extra) in enumerate(cases):  # sizes not divisible by P
            n = _two_shot_count(P, dt, extra)
            x = _data(n, rank, dt, i)
            got = await comm.allreduce(x, op=op, timeout=TIMEOUT)  # a new array
            check(f"{np.dtype(dt)}-{op}", got, partial(_want, n, P, dt, op, i))
            await bits(f"{np.dtype(dt)}-{op}", got, x, op)
            check(f"{np.dtype(dt)}-{op} input kept", x, _data(n, rank, dt, i))
        # a contiguous slice of a larger array, at an odd offset: reduced in place, and
        # nothing outside it touched (in this rank, or by a peer writing into it)
        n = _two_shot_count(P, np.float32, 3)
        big = np.full(n + 1000, -7.0, np.float32)
        view = big[333:333 + n]
        view[...] = _data(n, rank, np.float32, 20)
        before = view.copy()
        await comm.allreduce(view, out=view, timeout=TIMEOUT)
        check("slice", view, lambda: _want(n, P, np.float32, "sum", 20))
        await bits("slice", view, before, "sum")
        check("slice neighbours", np.concatenate([big[:333], big[333 + n:]]),
              np.full(1000, -7.0, np.float32))
        # out= another array, 2-D
        n2 = _two_shot_count(P, np.int64, 0)
        rows = -(-n2 // 64)
        x = _data(rows * 64, rank, np.int64, 21).reshape(rows, 64)
        out = np.zeros_like(x)
        res = await comm.allreduce(x, op="max", out=out, timeout=TIMEOUT)
        check("out=", res, lambda: _want(rows * 64, P, np.int64, "max", 21).reshape(rows, 64))
        check("out= input kept", x, _data(rows * 64, rank, np.int64, 21).reshape(rows, 64))
        if with_torch:  # torch tensors, in place (importing torch costs each rank 2 CPU-s)
            import torch

            t = torch.from_numpy(_data(n, rank, np.float32, 22))
            tr = await comm.allreduce(t, out=t, timeout=TIMEOUT)
            check("torch", tr.numpy(), lambda: _want(n, P, np.float32, "sum", 22))
            check("torch in place", t.numpy(), lambda: _want(n, P, np.float32, "sum", 22))
        # two sizes at once, three times (executors reused, calls interleaved)
        na, nb = _two_shot_count(P, np.float32, 1), _two_shot_count(P, np.float32, 4099)
        for step in range(3):
            a, b = _data(na, rank, np.float32, 30 + step), _data(nb, rank, np.float32, 40 + step)
            await asyncio.gather(comm.allreduce(a, out=a, timeout=TIMEOUT),
                                 comm.allreduce(b, op="max", out=b, timeout=TIMEOUT))
            check(f"gather a {step}", a, partial(_want, na, P, np.float32, "sum", 30 + step))
            check(f"gather b {step}", b, partial(_want, nb, P, np.float32, "max", 40 + step))
        cma = len(comm._dense._cma)
        await comm.barrier(timeout=TIMEOUT)
    return {"bad": bad, "cma": cma, "held": len(comm._dense._cma_held),
            "digests": digests}


@needs_cma
@pytest.mark.timeout(150)
@pytest.mark.parametrize("P", [3, 6])
def test_dtypes_odd_sizes_slices_out_torch_and_concurrent_calls(P: int) -> None:
    # torch tensors at P = 3 only; the spawn's limit leaves the test's timeout room to report
    before = _ours()
    out = spawn_world(async_child, P, (_mixed_main, free_port(), P == 3), 100)
    assert all(r["bad"] == [] for r in out), out
    # every key above took the single-copy path (8 dtype/op pairs, slice, out=, torch's shares
    # the slice's key, the two concurrent sizes)
    assert all(r["cma"] == 11 for r in out), out
    assert all(r["held"] == 0 for r in out), out
    # every reduced result the same bytes on every rank (rank 0 checked them against numpy)
    assert len(out[0]["digests"]) >= 12
    assert all(r["digests"] == out[0]["digests"] for r in out)
    assert _ours() - before == set()


# -- groups: the group's ranks, not the job's ---------------------------------------------------
async def _group_main(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {"pid": os.getpid(), "bad": []}
    async with comm:
        # two groups at once, each of two ranks in reverse order of the job's: group rank 0
        # of {0, 2} is the job's rank 2, of {1, 3} rank 3
        g = await comm.split(rank % 2, key=-rank, timeout=TIMEOUT)
        assert g is not None
        got["members"] = list(g.members)
        n = _two_shot_count(g.size, np.float32, 5)
        for step in range(2):
            x = _data(n, 10 + rank, np.float32, step)  # by the job's rank: who sent what
            ref = x.copy()
            await g.allreduce(x, out=x, timeout=TIMEOUT)
            await g.allreduce(ref, algorithm="shm_two_shot", out=ref, timeout=TIMEOUT)
            want = sum(_data(n, 10 + m, np.float32, step) for m in g.members)
            if not (np.array_equal(x, ref) and np.allclose(x, want, atol=1e-4)):
                got["bad"].append(f"group {step}")
        got["group_pids"] = g._dense._cma_pids
        got["group_cma"] = len(g._dense._cma)
        await g.close(timeout=TIMEOUT)
        # and the job's own, after: its own probe, by the job's ranks
        n = _two_shot_count(P, np.int32, 1)
        y = _data(n, rank, np.int32, 9)
        await comm.allreduce(y, out=y, timeout=TIMEOUT)
        if not np.array_equal(y, sum(_data(n, q, np.int32, 9) for q in range(P))):
            got["bad"].append("world")
        got["world_pids"] = comm._dense._cma_pids
        await comm.barrier(timeout=TIMEOUT)
    return got


@needs_cma
@pytest.mark.timeout(60)
def test_groups_probe_and_index_process_ids_by_group_rank() -> None:
    out = spawn_world(async_child, 4, (_group_main, free_port()), 50)
    pids = [r["pid"] for r in out]
    assert all(r["bad"] == [] for r in out), out
    assert [r["members"] for r in out] == [[2, 0], [3, 1], [2, 0], [3, 1]], out
    for r in out:  # group rank i's process id at i: the job's rank members[i]
        assert r["group_pids"] == [pids[m] for m in r["members"]], (r, pids)
        assert r["group_cma"] == 1, r
        assert r["world_pids"] == pids, (r, pids)


# -- a rank whose probe cannot read (or write) a peer ----------------------------------------
async def _refuse_main(rank: int, P: int, port: int, how: str) -> dict[str, Any]:
    from asynccoll.comm import shm_ops

    if rank == P - 1:
        def refuse(*args: Any) -> None:
            raise PermissionError(1, "Operation not permitted")
        setattr(shm_ops, how, refuse)  # only the probe calls these through shm_ops
    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {"bad": []}
    async with comm:
        for step, (dt, op) in enumerate(((np.float32, "sum"), (np.int64, "max"),
                                          (np.float32, "sum"))):
            n = _two_shot_count(P, dt, 2 * step + 1)
            x = _data(n, rank, dt, step)
            res = await comm.allreduce(x, op=op, timeout=TIMEOUT)
            want = _RED[op].reduce([_data(n, q, dt, step) for q in range(P)], axis=0)
            if not np.allclose(res, want, atol=1e-4):
                got["bad"].append(step)
        # an array in shared memory too: the in-place two-shot, not the single-copy path
        a = await comm.empty(_two_shot_count(P, np.float32), np.float32, timeout=TIMEOUT)
        a[...] = rank + 1
        await comm.allreduce(a, out=a, timeout=TIMEOUT)
        if not (a == P * (P + 1) / 2).all():
            got["bad"].append("arena")
        got["pids"] = comm._dense._cma_pids
        got["cma"] = len(comm._dense._cma)
        await comm.barrier(timeout=TIMEOUT)
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["read_remote", "write_remote"])
def test_one_rank_refused_by_the_kernel_turns_it_off_for_all(how: str) -> None:
    before = _ours()
    out = spawn_world(async_child, 3, (_refuse_main, free_port(), how), 50)
    assert all(r["bad"] == [] for r in out), out
    assert all(r["pids"] == [] and r["cma"] == 0 for r in out), out  # every rank fell back
    assert _ours() - before == set()


# -- a cancelled call, then the next ones ------------------------------------------------------
async def _cancel_main(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {}
    n = _two_shot_count(P, np.float32, 7)
    async with comm:
        x = np.ones(n, np.float32)
        await comm.allreduce(x, out=x, timeout=TIMEOUT)  # set up on every rank
        y = np.full(n, 2.0, np.float32)
        if rank == 0:  # gives up before rank 1 even calls: it never reduced its block
            task = asyncio.ensure_future(comm.allreduce(y, out=y, timeout=TIMEOUT))
            await asyncio.sleep(0.3)
            task.cancel()
            try:
                await task
                got["second"] = "completed"
            except asyncio.CancelledError:
                got["second"] = "cancelled"
            await asyncio.sleep(1.5)
        else:
            await asyncio.sleep(0.8)
            try:
                await comm.allreduce(y, out=y, timeout=1.5)
                got["second"] = "completed"
            except asynccoll.CollectiveTimeoutError:
                got["second"] = "timeout"
        got["held"] = any(np.shares_memory(h, y) for h in comm._dense._cma_held)
        # the next calls set up afresh on every rank alike, and are right
        for step in range(2):
            z = _data(n, rank, np.float32, step)
            await comm.allreduce(z, out=z, timeout=TIMEOUT)
            want = sum(_data(n, q, np.float32, step) for q in range(P))
            got[f"third{step}"] = bool(np.allclose(z, want, atol=1e-4))
        got["cma"] = len(comm._dense._cma)
        await comm.barrier(timeout=TIMEOUT)
    got["held_after_close"] = len(comm._dense._cma_held)
    return got


@needs_cma
@pytest.mark.timeout(60)
def test_a_cancelled_call_is_held_fails_its_peer_and_the_next_calls_recover() -> None:
    before = _ours()
    out = spawn_world(async_child, 2, (_cancel_main, free_port()), 50)
    assert [r["second"] for r in out] == ["cancelled", "timeout"], out
    assert all(r["held"] for r in out), out  # both abandoned arrays kept alive
    assert all(r["third0"] and r["third1"] for r in out), out
    assert all(r["cma"] == 1 for r in out), out  # set up again, single-copy again
    assert all(r["held_after_close"] == 0 for r in out), out
    assert _ours() - before == set()


# -- the blocking API from several threads -------------------------------------------------------
def _threads_child(rank: int, P: int, port: int, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        comm = asynccoll.init(rank=rank, world_size=P, store=f"127.0.0.1:{port}", timeout=60,
                              collective_timeout=TIMEOUT * 2)
        sizes = {"a": _two_shot_count(P, np.float32, 1), "b": _two_shot_count(P, np.float64, 3)}
        dts = {"a": np.float32, "b": np.float64}
        with comm:
            for k in sizes:  # set up from one thread, in one order on every rank
                comm.allreduce(_data(sizes[k], rank, dts[k]))
            bad: list[str] = []

            def loop(k: str) -> None:
                try:
                    for step in range(4):
                        x = _data(sizes[k], rank, dts[k], step)
                        res = comm.allreduce(x)
                        want = sum(_data(sizes[k], p, dts[k], step) for p in range(P))
                        if not np.allclose(res, want, atol=1e-4):
                            bad.append(f"{k}{step}")
                except BaseException:
                    bad.append(traceback.format_exc())

            threads = [threading.Thread(target=loop, args=(k,)) for k in sizes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cma = len(comm.comm._dense._cma)
            comm.barrier()
        q.put((rank, "ok", {"bad": bad, "cma": cma}))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


@needs_cma
@pytest.mark.timeout(60)
def test_blocking_calls_of_two_sizes_from_two_threads() -> None:
    out = spawn_world(_threads_child, 3, (free_port(),), 50)
    assert all(r["bad"] == [] for r in out), out
    assert all(r["cma"] == 2 for r in out), out


# -- a probe given up on one rank ---------------------------------------------------------------
async def _probe_cancel_main(rank: int, P: int, port: int) -> dict[str, Any]:
    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {}
    n = _two_shot_count(P, np.float32)
    x = np.ones(n, np.float32)
    if rank == 0:  # its row is out; it gives up before rank 1 has even called
        task = asyncio.ensure_future(comm.allreduce(x, out=x, timeout=TIMEOUT))
        await asyncio.sleep(0.4)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.5)  # (the cancellation reaches the progress thread's call)
        got["held"] = [h.tobytes() for h in comm._dense._cma_held]
    else:  # calls late: reads rank 0's row, then rank 0's marker, and writes it back
        await asyncio.sleep(0.8)
        with contextlib.suppress(Exception):
            await comm.allreduce(x, out=x, timeout=1.0)
    await comm.close(timeout=0)
    got["held_after_close"] = len(comm._dense._cma_held)
    return got


@needs_cma
@pytest.mark.timeout(60)
def test_a_probe_given_up_keeps_its_marker_alive_for_the_peers_that_write_it() -> None:
    """A peer that got this rank's row still reads its marker and writes it back: the marker
    must outlive the cancelled call (as a failed call's array does), not be freed and reused
    under that write."""
    out = spawn_world(async_child, 2, (_probe_cancel_main, free_port()), 50)
    held = out[0]["held"]
    assert len(held) == 1, out
    assert len(held[0]) == 8, out  # the one 8-byte marker
    assert out[0]["held_after_close"] == 0, out


# -- a rank that gave up and closed while a slow peer is still mid-reduce -------------------------
async def _closed_main(rank: int, P: int, port: int) -> dict[str, Any]:
    import gc
    import time

    from asynccoll.comm import cma

    comm = await _connect(rank, P, port)
    got: dict[str, Any] = {}
    n = _two_shot_count(P, np.float32)
    x = np.ones(n, np.float32)
    await comm.allreduce(x, out=x, timeout=TIMEOUT)  # set up
    if rank == 1:  # a slow (live) peer: about 1.3 s to read and write its block, whatever
        real = cma._peer  # the piece size (one read and one write per piece)
        pieces = -(-(n // P) * 4 // cma.CMA_PIECE)
        pause = 1.3 / (2 * pieces)

        def slow(*args: Any) -> None:
            time.sleep(pause)
            real(*args)
        cma._peer = slow  # type: ignore[assignment]
    y = np.full(n, 3.0, np.float32)
    if rank == 0:  # reduces its block at once, says "written", then gives up waiting
        with contextlib.suppress(asynccoll.CollectiveTimeoutError):
            await comm.allreduce(y, out=y, timeout=0.6)
            got["second"] = "completed"
        await comm.close(timeout=0)  # and goes on living (elastic training, a retry...)
        del y
        gc.collect()
        fresh = [np.full(n, 5.0, np.float32) for _ in range(3)]  # the allocator's next arrays
        await asyncio.sleep(2.5)  # rank 1's reduce ends meanwhile
        got["intact"] = all(bool((z == 5.0).all()) for z in fresh)
    else:
        await asyncio.sleep(0.3)
        try:
            res = await comm.allreduce(y, out=y, timeout=TIMEOUT)
            got["second"] = "completed"
            got["right"] = bool((res == 2 * 3.0).all())
        except Exception as exc:
            got["second"] = type(exc).__name__
        await comm.close(timeout=0)
    return got


@needs_cma
@pytest.mark.timeout(60)
def test_a_live_peer_mid_reduce_never_writes_into_memory_freed_after_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 gives up (after its own block is done) and closes; rank 1, slow but alive, goes
    on reading and writing rank 0's array. The array must outlive the close: freed, glibc hands
    it to the next arrays (big chunks from the heap here, as jemalloc/tcmalloc would), rank 1
    writes its block over them and completes with their values in its result."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 20))  # the ranks' malloc reuses
    out = spawn_world(async_child, 2, (_closed_main, free_port()), 50)
    assert out[0].get("second") is None, out  # rank 0 did give up
    assert out[0]["intact"], out  # nothing of rank 0's new data overwritten
    if out[1]["second"] == "completed":  # completing is fine: on rank 0's input, not garbage
        assert out[1]["right"], out
