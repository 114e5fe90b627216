"""Adversarial review of two fixes: calls of one collective keep their order (fa8a830) and a
program that ends without closing closes at exit (3cfd099). The cases it found broken are
fixed (each test's docstring says which).

Part 1 (in-process worlds): the order of calls made while a first use sets up. Part 2
(multi-process jobs, launched as ``tests/adversarial/test_exit_without_close.py`` does): how
a rank that ends without closing leaves, and how long its exit and its peers' waits take.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import free_port

from asynccoll import CollectiveTimeoutError, ExecutionError
from asynccoll.testing import local_world

pytestmark = pytest.mark.alone  # timing-sensitive: runs after the parallel part (Makefile)

ROOT = str(Path(__file__).parents[2])
BIG = 1 << 16  # float32: 256 KiB, above SHM_MIN_BYTES (every local_world rank on one host)


def _fill(n: int, v: float, dtype: Any = np.float32) -> np.ndarray:
    return np.full(n, v, dtype)


def _first(v: Any) -> Any:
    return v if isinstance(v, BaseException) else float(np.asarray(v).reshape(-1)[0])


# -- part 1: order of calls -------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [4, BIG], ids=["network", "shm"])
async def test_four_concurrent_first_uses_pair_in_call_order(n: int) -> None:
    """Rank 0 makes four calls of one allreduce at once (its first use), the others one after
    the other: call k pairs with call k everywhere (shared memory too)."""
    P, K = 3, 4
    async with local_world(P, "tcp", timeout=10) as comms:
        async def rank(r: int) -> list[Any]:
            c = comms[r]
            if r == 0:
                return list(await asyncio.gather(
                    *(c.allreduce(_fill(n, 10.0 * k + r + 1)) for k in range(K))))
            return [await c.allreduce(_fill(n, 10.0 * k + r + 1)) for k in range(K)]

        got = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 30)
    for k in range(K):
        want = sum(_fill(n, 10.0 * k + r + 1) for r in range(P))
        for r in range(P):
            np.testing.assert_array_equal(got[r][k], want, err_msg=f"rank {r}, call {k}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["allreduce", "allreduce_shm", "broadcast", "sparse"])
async def test_a_call_cancelled_while_queued_behind_a_first_use_keeps_the_ids_in_step(
        kind: str) -> None:
    """Rank 0 makes three calls at once while the peers are late (its first call waits in the
    agreement) and cancels the second while it is queued; the peers make two. The first and
    third pair with the peers' two, and later collectives still pair (schedule ids in step)."""
    P = 3
    n = BIG if kind == "allreduce_shm" else 4
    async with local_world(P, "tcp", timeout=10) as comms:
        def op(c: Any, r: int, k: int) -> Any:
            x = _fill(n, 10.0 * k + r + 1)
            if kind == "broadcast":
                return c.broadcast(x, root=1)
            if kind == "sparse":
                return c.sparse_allreduce(x)
            return c.allreduce(x)

        async def rank(r: int) -> list[Any]:
            c = comms[r]
            if r == 0:
                ts = [asyncio.ensure_future(op(c, r, k)) for k in range(3)]
                await asyncio.sleep(0.1)
                assert not ts[0].done()
                ts[1].cancel()
                out = await asyncio.gather(*ts, return_exceptions=True)
                assert isinstance(out[1], asyncio.CancelledError), out[1]
                out = [out[0], out[2]]
            else:
                await asyncio.sleep(0.4)
                out = [await op(c, r, 0), await op(c, r, 2)]
            y = await c.allreduce(np.full(5, r + 1.0))
            z = await c.broadcast(np.full(3, r + 7.0), root=2)
            return [_first(v) for v in out] + [_first(y), _first(z)]

        got = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 30)
    first, third = ((2.0, 22.0) if kind == "broadcast" else (6.0, 66.0))
    for r in range(P):
        assert got[r] == [first, third, 6.0, 9.0], (r, got)


@pytest.mark.timeout(30)
async def test_different_collectives_in_different_orders_fail_clearly_on_every_rank() -> None:
    """A user error (each rank starts allreduce, broadcast and allgather at once, in a different
    order): every call on every rank raises ExecutionError naming the disagreement, at once (no
    hang until the timeout)."""
    P = 3
    async with local_world(P, "tcp", timeout=20) as comms:
        async def rank(r: int) -> list[Any]:
            c = comms[r]
            ops = {"ar": lambda: c.allreduce(np.full(4, r + 1.0)),
                   "bc": lambda: c.broadcast(np.full(4, r + 1.0)),
                   "ag": lambda: c.allgather(np.full(4, r + 1.0))}
            order = [["ar", "bc", "ag"], ["bc", "ag", "ar"], ["ag", "ar", "bc"]][r]
            return list(await asyncio.gather(*(ops[k]() for k in order),
                                             return_exceptions=True))

        t = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(P))), 25)
        took = time.monotonic() - t
    assert took < 5, took
    for r in range(P):
        for v in got[r]:
            assert isinstance(v, ExecutionError), (r, v)
            assert "disagree" in str(v), (r, v)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [4, BIG], ids=["network", "shm"])
async def test_blocking_allreduce_from_three_threads_per_rank(n: int) -> None:
    """comm.blocking.allreduce from three threads of each rank at once (first use): no hang,
    and the ranks agree on the three sums (which thread pairs with which is the threads'
    race, but each execution gives every rank the same sum of one call per rank)."""
    P, T = 3, 3
    async with local_world(P, "tcp", timeout=10) as comms:
        def rank_threads(r: int) -> list[Any]:
            c = comms[r]
            outs: list[Any] = [None] * T

            def work(k: int) -> None:
                try:
                    outs[k] = c.blocking.allreduce(_fill(n, 100.0 * k + r + 1))
                except BaseException as exc:  # reported below
                    outs[k] = exc

            ths = [threading.Thread(target=work, args=(k,)) for k in range(T)]
            for th in ths:
                th.start()
            for th in ths:
                th.join(30)
            return outs

        got = await asyncio.wait_for(asyncio.gather(
            *(asyncio.to_thread(rank_threads, r) for r in range(P))), 40)
    sums = []
    for r in range(P):
        for v in got[r]:
            assert isinstance(v, np.ndarray), (r, v)
            assert np.all(v == v[0]), r
        sums.append(sorted(float(v[0]) for v in got[r]))
    assert sums[0] == sums[1] == sums[2], sums
    assert sum(sums[0]) == sum(100.0 * k + r + 1 for k in range(T) for r in range(P))


async def _in_flight_case(case: str, r: int, c: Any) -> list[Any]:
    """Each rank calls the same collectives in the same order (the MPI rule); rank 0 (or rank
    1 later) has the second started before the first returned, as ``create_task`` allows."""
    if case == "shm_then_small":
        a, b = _fill(BIG, r + 1.0), np.full(4, 10.0 * (r + 1))
        if r == 0:
            return list(await asyncio.gather(c.allreduce(a), c.allreduce(b),
                                             return_exceptions=True))
        return [await c.allreduce(a), await c.allreduce(b)]
    if case == "default_then_named_shm":
        a = _fill(BIG, r + 1.0)
        if r == 0:
            return list(await asyncio.gather(c.allreduce(a), c.allreduce(a, algorithm="shm"),
                                             return_exceptions=True))
        return [await c.allreduce(a), await c.allreduce(a, algorithm="shm")]
    if case == "shm_then_broadcast_issued_later":
        await c.barrier()
        a, b = _fill(BIG, r + 1.0), np.full(4, 10.0 * (r + 1))
        t1 = asyncio.ensure_future(c.allreduce(a))
        if r == 1:
            await asyncio.sleep(0.5)
        t2 = asyncio.ensure_future(c.broadcast(b))
        return list(await asyncio.gather(t1, t2, return_exceptions=True))
    if case == "two_empties":
        if r == 0:
            got = await asyncio.gather(c.empty(1000), c.empty(2000), return_exceptions=True)
        else:
            got = [await c.empty(1000), await c.empty(2000)]
        if any(isinstance(v, BaseException) for v in got):
            return list(got)
        x, y = got
        x[...] = r + 1
        y[...] = 10 * (r + 1)
        return [await c.allreduce(x, out=x), await c.allreduce(y, out=y)]
    raise AssertionError(case)


_WANT = {"shm_then_small": (3.0, 30.0), "default_then_named_shm": (3.0, 3.0),
         "shm_then_broadcast_issued_later": (3.0, 10.0), "two_empties": (3.0, 30.0)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(_WANT))
async def test_a_first_use_through_shared_memory_is_not_overtaken_by_another_call(
        case: str) -> None:
    """Fixed: the shared-memory setup (``_shm_setup``, ``shared_empty``) took its schedule
    ids, and its barrier's, after an await (the agreement, the segment mapping), and agreed on
    its own barrier's definition, so a call made meanwhile (a different collective, or the
    same allreduce named ``"shm"``: another order lock, the same segments) took its id (or its
    agreement) first on one rank and later on another: every rank timed out or raised a false
    ExecutionError("disagree") although every rank made the same calls in the same order.
    The host layout is learnt first, as ``connect()`` does: a communicator that has not learnt
    it yet learns it at its first allreduce of 128 KiB or more, an await before which a call
    made meanwhile can still take its id first (docs/communicator.md)."""
    P = 2
    async with local_world(P, "tcp", timeout=2) as comms:
        await asyncio.gather(*(c.sync_clocks() for c in comms))  # the host layout, as connect()
        got = await asyncio.wait_for(asyncio.gather(
            *(_in_flight_case(case, r, comms[r]) for r in range(P)), return_exceptions=True), 30)
    for r in range(P):
        assert not isinstance(got[r], BaseException), (r, got[r])
        assert tuple(_first(v) for v in got[r]) == _WANT[case], (r, got[r])


# -- part 2: exit without close -----------------------------------------------------------------
RANK = '''
import atexit, sys, time
T0 = time.monotonic()
ENDED = []
# registered before asynccoll is imported: runs after its exit hooks (atexit is LIFO)
atexit.register(lambda: print("atexit-done", round(time.monotonic() - ENDED[0], 2)
                              if ENDED else -1, flush=True))
import asyncio, os
import numpy as np
import asynccoll

MODE, CT = sys.argv[1], float(sys.argv[2])


def say(*a):
    print(*a, flush=True)


async def stuck_peer(comm):
    t = time.monotonic()
    try:
        await comm.barrier()  # one that rank 0 never calls
        say("done")
    except Exception as exc:
        say("err", type(exc).__name__, getattr(exc, "rank", None),
            round(time.monotonic() - t, 2))


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=40)  # never closed
    comm.close_timeout = CT
    if MODE == "groups":
        sub = await comm.split(0 if comm.rank < 2 else 1)
        sub.close_timeout = CT
    if MODE == "two":
        other = await asynccoll.connect(store="127.0.0.1:" + sys.argv[3], timeout=60,
                                        collective_timeout=40)
        other.close_timeout = CT
        await other.barrier()
    await comm.barrier()
    if MODE == "fork":
        return comm
    if comm.rank == 0:
        if MODE == "sysexit":
            sys.exit(3)
        if MODE == "kbi":
            raise KeyboardInterrupt
        return
    if MODE == "two":
        await asyncio.gather(stuck_peer(comm), stuck_peer(other))
    else:
        await stuck_peer(comm)


comm = asyncio.run(main())
if MODE == "fork":
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked helper that ends normally
    t = time.monotonic()
    os.waitpid(pid, 0)
    say("child-exit", round(time.monotonic() - t, 2))
    asyncio.run(comm.close())
ENDED.append(time.monotonic())
'''


def _job(tmp_path: Path, mode: str, ct: float, P: int = 2,
         extra: tuple[str, ...] = ()) -> list[tuple[int, float, str, str]]:
    """Run a P-rank job of RANK; per rank: (exit code, seconds to exit, stdout, stderr)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    t0 = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, str(script), mode, str(ct), *extra],
        env={**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
             "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
             "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": "review-order-exit-secret"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(P)]
    done: dict[int, float] = {}
    try:
        while len(done) < P and time.monotonic() - t0 < 60:
            for r, p in enumerate(procs):
                if r not in done and p.poll() is not None:
                    done[r] = time.monotonic() - t0
            time.sleep(0.02)
        outs = [p.communicate(timeout=5) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, round(done.get(r, -1.0), 2), out.decode(),
             err.decode(errors="replace")[-1500:])
            for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True))]


def _line(out: str, word: str) -> list[str]:
    for line in out.splitlines():
        if line.startswith(word + " "):
            return line.split()
    raise AssertionError(f"no {word!r} line in {out!r}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("CT", [3.0, 0.0])
def test_a_normal_end_serves_a_stuck_peer_for_close_timeout_then_leaves(
        tmp_path: Path, CT: float) -> None:
    """Documented (close()'s contract): rank 0 ends while rank 1 waits in a barrier rank 0
    never calls. Rank 0 waits for rank 1's goodbye for close_timeout, then leaves (exit code 0,
    its exit hook done within close_timeout + a few seconds); rank 1 learns of it then, as a
    PeerLostError naming rank 0, not before. close_timeout=0 (set on the communicator:
    connect() takes no close_timeout): no goodbyes, the peer learns at once."""
    got = _job(tmp_path, "stuck", CT)
    (rc0, _, out0, _err0), (rc1, _, out1, _err1) = got
    assert (rc0, rc1) == (0, 0), got
    assert float(_line(out0, "atexit-done")[1]) < CT + 3, out0
    _, kind, rank, secs = _line(out1, "err")
    assert (kind, rank) == ("PeerLostError", "0"), out1
    assert max(CT - 0.5, 0) <= float(secs) < CT + 3, out1


@pytest.mark.timeout(60)
def test_a_keyboard_interrupt_leaves_at_once(tmp_path: Path) -> None:
    """KeyboardInterrupt is an uncaught exception: no goodbyes, the peer learns at once."""
    got = _job(tmp_path, "kbi", 20.0)
    (rc0, _t0, out0, err0), (_rc1, _, out1, _err1) = got
    assert rc0 != 0, got[0]
    assert "KeyboardInterrupt" in err0, got[0]
    assert float(_line(out0, "atexit-done")[1]) == -1  # main did not return
    _, kind, rank, secs = _line(out1, "err")
    assert (kind, rank) == ("PeerLostError", "0"), out1
    assert float(secs) < 3, out1


@pytest.mark.timeout(60)
def test_sys_exit_with_an_error_code_closes_as_close_does(tmp_path: Path) -> None:
    """Documented (docs/communicator.md, "Closing"): ``sys.exit(3)`` leaves no trace an exit
    hook can read (SystemExit never sets sys.last_value, and atexit does not see the code), so
    it ends like a normal end: the rank closes as close() does, and a peer stuck in a
    collective the rank never calls learns of it after close_timeout, not at once (raise, or
    close(timeout=0), to leave at once). The exit code stays 3."""
    CT = 3.0
    got = _job(tmp_path, "sysexit", CT)
    (rc0, _t0, _out0, _err0), (_rc1, _, out1, _err1) = got
    assert rc0 == 3, got[0]
    _, kind, rank, secs = _line(out1, "err")
    assert (kind, rank) == ("PeerLostError", "0"), out1
    assert CT - 0.5 <= float(secs) < CT + 3, out1


@pytest.mark.timeout(60)
def test_a_forked_child_that_ends_normally_exits_at_once(tmp_path: Path) -> None:
    """Fixed (a regression of 3cfd099, found in review): a process forked after connect()
    inherits the exit hook and the open communicators, but not their progress thread; its exit
    hook submitted close() to a loop that nobody runs and waited close_timeout + 5 s for it
    (35 s by default), where it used to exit at once."""
    CT = 4.0
    got = _job(tmp_path, "fork", CT)
    for r, (rc, _, out, _err) in enumerate(got):
        assert rc == 0, (r, got[r])
        secs = float(_line(out, "child-exit")[1])
        assert secs < 2.5, f"rank {r}: the forked child took {secs} s to exit"


@pytest.mark.timeout(60)
def test_two_communicators_left_open_close_together(tmp_path: Path) -> None:
    """Two communicators of one process (two jobs), both left open, the peer stuck in both:
    they close at once (about close_timeout, not twice that), and the peer learns of both."""
    CT = 3.0
    got = _job(tmp_path, "two", CT, extra=(str(free_port()),))
    (rc0, _, out0, _err0), (rc1, _, out1, _err1) = got
    assert (rc0, rc1) == (0, 0), got
    assert float(_line(out0, "atexit-done")[1]) < CT + 3, out0
    errs = [line.split() for line in out1.splitlines() if line.startswith("err ")]
    assert len(errs) == 2, out1
    for _, kind, rank, secs in errs:
        assert (kind, rank) == ("PeerLostError", "0"), out1
        assert float(secs) < CT + 3, out1


@pytest.mark.timeout(60)
def test_a_communicator_with_a_group_left_open_closes_within_close_timeout(
        tmp_path: Path) -> None:
    """Fixed (found in review, older than the exit hook): rank 0 made one group (comm.split)
    and ends; its peers wait in a barrier it never calls. close() closed the group first and
    waited close_timeout for its goodbyes, then the world for close_timeout more: the stuck
    peers learnt of the end after 2 x close_timeout, although ``close(timeout=)`` is
    documented to bound the wait. One deadline now bounds the groups and the world."""
    CT = 4.0
    got = _job(tmp_path, "groups", CT, P=3)
    for r, (rc, _, _out, _err) in enumerate(got):
        assert rc == 0, (r, got[r])
    assert float(_line(got[0][2], "atexit-done")[1]) < CT + 2, got[0]
    for r in (1, 2):
        _, kind, rank, secs = _line(got[r][2], "err")
        assert (kind, rank) == ("PeerLostError", "0"), got[r]
        assert float(secs) < CT + 2, (r, got[r][2])


@pytest.mark.timeout(30)
async def test_a_closing_rank_is_named_as_closing_in_a_peers_timeout() -> None:
    """Found in review: a rank that closes (and waits for the others' goodbyes) did not answer
    status probes, so a peer's timeout called it "not responding (stopped, blocked or gone)".
    It answers now, and the peer's error says it is closing."""
    async with local_world(2, "tcp", timeout=10) as comms:
        closing = asyncio.ensure_future(comms[0].close(timeout=5))
        await asyncio.sleep(0.2)  # rank 0 waits for rank 1's goodbye
        with pytest.raises(CollectiveTimeoutError) as info:
            await comms[1].barrier(timeout=1.0)
        text = str(info.value)
        assert "closing" in text, text
        assert "not responding" not in text, text
        await comms[1].close(timeout=5)
        await asyncio.wait_for(closing, 10)
