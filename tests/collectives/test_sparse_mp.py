"""Sparse allreduce in real processes over tcp and ucx, P = 2..4, every algorithm.

Each child listens, reports its address through a queue, receives everyone's, connects and runs
the collectives on seeded data; the parent checks the results against the dense sum. Children
send a formatted traceback on failure and are killed in ``finally`` whatever happens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import queue
import traceback
from typing import Any

import numpy as np
import pytest

SECRET = b"sparse-test-secret-0123456789"
ALGOS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather")
N = 5003  # not divisible by P


def rank_input(rank: int, case: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    x = np.zeros(N, np.float32)
    m = rng.random(N) < (0.002, 0.05, 0.6)[case]
    x[m] = rng.integers(-9, 10, int(m.sum()))
    return x


async def _child_main(kind: str, rank: int, P: int, addr_q: Any, peers_q: Any) -> list[Any]:
    from asynccoll.collectives.sparse import to_dense
    from asynccoll.comm.sparse import sparse_allreduce

    if kind == "tcp":
        from asynccoll.transport.tcp import TcpTransport

        t: Any = TcpTransport(rank, P, secret=SECRET)
        addr = await t.listen("tcp://127.0.0.1:0")
    else:
        from asynccoll.transport.ucx import UcxTransport

        t = UcxTransport(rank, P, secret=SECRET)
        addr = await t.listen("ucx://127.0.0.1:0")
    addr_q.put((rank, addr))
    peers = await asyncio.get_running_loop().run_in_executor(None, peers_q.get, True, 60)
    try:
        await t.connect({r: a for r, a in peers.items() if r != rank}, timeout=15)
        out = []
        sid = 1
        for algo in ALGOS:
            for case in range(3):
                res = await sparse_allreduce(t, rank_input(rank, case), sched_id=sid,
                                             algorithm=algo, timeout=15)
                sid += 1
                out.append((algo, case, type(res).__name__, to_dense(res).tobytes()))
        res = await sparse_allreduce(t, rank_input(rank, 2), sched_id=sid, quantize=4,
                                     timeout=15)
        out.append(("qsgd4", 2, type(res).__name__, res.tobytes()))
        return out
    finally:
        await t.close()


def _child(kind: str, rank: int, P: int, addr_q: Any, peers_q: Any, res_q: Any) -> None:
    try:
        res_q.put((rank, "ok", asyncio.run(_child_main(kind, rank, P, addr_q, peers_q))))
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


def _run_world(kind: str, P: int) -> dict[int, list[Any]]:
    ctx = mp.get_context("spawn")
    addr_q, res_q = ctx.Queue(), ctx.Queue()
    peer_qs = [ctx.Queue() for _ in range(P)]
    procs = [ctx.Process(target=_child, args=(kind, r, P, addr_q, peer_qs[r], res_q),
                         daemon=True) for r in range(P)]
    try:
        for p in procs:
            p.start()
        addrs: dict[int, str] = {}
        while len(addrs) < P:
            try:
                r, a = addr_q.get(timeout=60)
            except queue.Empty:
                # a child that failed before listening reports on the result queue
                r, status, detail = res_q.get(timeout=5)
                raise AssertionError(f"rank {r} failed before listening:\n{detail}") from None
            addrs[r] = a
        for q in peer_qs:
            q.put(addrs)
        results: dict[int, list[Any]] = {}
        while len(results) < P:
            r, status, detail = res_q.get(timeout=90)
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{detail}")
            results[r] = detail
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _check(results: dict[int, list[Any]], P: int) -> None:
    first = results[0]
    for r in range(1, P):
        assert results[r] == first, f"rank {r} differs from rank 0"
    for algo, case, typ, raw in first:
        got = np.frombuffer(raw, np.float32)
        want = np.sum([rank_input(r, case) for r in range(P)], axis=0)
        if algo == "qsgd4":
            assert typ == "ndarray"
            assert np.abs(got - want).max() <= np.abs(want).max() / 7 + 1e-4
        else:
            assert np.array_equal(got, want), (algo, case)
            if algo == "dsar_split_allgather":
                assert typ == "ndarray"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_sparse_allreduce_over_tcp(P: int) -> None:
    _check(_run_world("tcp", P), P)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_sparse_allreduce_over_ucx(P: int) -> None:
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (pip install 'asynccoll[ucx]')")
    _check(_run_world("ucx", P), P)
