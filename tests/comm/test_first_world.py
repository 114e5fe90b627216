"""The first world of a job that may grow (``Grouping.first_world``), over real tcp sockets:
what ``connect()`` returns on a first-world rank, its close (the job's with it, the progress
thread given back even after the job grew), and the vacant ranks as the membership reads them.

Two ranks of a job of three (rank 2 vacant), each with its own progress thread, in one process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from asynccoll.comm import Communicator, ProgressEngine
from asynccoll.comm.joining import Joiners
from asynccoll.comm.membership import Membership
from asynccoll.sched import LiveOps
from asynccoll.transport.tcp import TcpTransport

SECRET = b"f" * 32

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def world() -> Iterator[tuple[list[ProgressEngine], list[TcpTransport], dict[int, str]]]:
    """Ranks 0 and 1 connected, rank 2 vacant and admitted (as rendezvous leaves them)."""
    engines = [ProgressEngine.thread(use_uvloop=False) for _ in range(2)]

    async def make(r: int) -> tuple[TcpTransport, str]:
        t = TcpTransport(r, 3, secret=SECRET)
        return t, await t.listen("tcp://127.0.0.1:0")

    made = [engines[r].run_blocking(make(r)) for r in range(2)]
    ts, addrs = [m[0] for m in made], {r: m[1] for r, m in enumerate(made)}

    def connect(r: int) -> None:
        engines[r].run_blocking(ts[r].connect({1 - r: addrs[1 - r]}, timeout=10))

    _both(connect)
    for r in range(2):
        engines[r].call(lambda r=r: (setattr(ts[r], "admit_rejoins", True),
                                     ts[r].vacate([2])))
    yield engines, ts, addrs
    for r in range(2):
        if not engines[r].closed:
            engines[r].run_blocking(ts[r].close())
            engines[r].close()


def _both(fn: Any) -> None:
    """``fn(0)`` and ``fn(1)`` at once, on two threads; what either raised, raised here."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as exc:
            errors.append(exc)

    th = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join(30)
    if errors:
        raise errors[0]


def test_the_first_world_is_the_jobs_first_ranks_and_closes_the_job_with_it(world: Any) -> None:
    engines, ts, _ = world
    jobs = [Communicator(ts[r], progress=engines[r], survive=True) for r in range(2)]
    firsts = [j.first_world(2) for j in jobs]
    assert [(f.rank, f.size, f.members, f.job is j) for f, j in zip(firsts, jobs, strict=True)] \
        == [(0, 2, (0, 1), True), (1, 2, (0, 1), True)]
    assert all(f.survive for f in firsts)
    with pytest.raises(ValueError, match="made from the job's communicator"):
        firsts[0].first_world(1)
    with pytest.raises(ValueError, match="this rank"):
        jobs[1].first_world(1)

    def close(r: int) -> None:
        firsts[r].blocking.close()

    _both(close)
    assert all(j.closed for j in jobs)


def test_a_blocking_close_gives_the_progress_thread_back_after_the_job_grew(world: Any) -> None:
    """``asynccoll.init()``'s close: the first world, the job and a grown communicator
    (``rejoined_group``, as an admission makes it) are all closed on the loop; every hold on
    the progress engine is given back, so its thread stops (it stayed alive before)."""
    engines, ts, _ = world
    jobs = [Communicator(ts[r], progress=engines[r], survive=True) for r in range(2)]
    firsts = [j.first_world(2) for j in jobs]
    for j in jobs:
        j.rejoined_group([0, 1], "join:x:1")

    def close(r: int) -> None:
        firsts[r].blocking.close()

    _both(close)
    assert all(j.closed for j in jobs)
    assert [e.closed for e in engines] == [True, True]
    assert not any(e.thread_alive for e in engines)


def test_a_rank_taken_before_the_membership_listens_is_not_left_vacant(world: Any) -> None:
    """A new process takes rank 2 between the membership's creation and its ``watch()`` (a
    new rank dialling while the first world's communicator is being made): the membership
    reads the vacant ranks on the loop, so rank 2 is a live rank there, counted as grown, and
    a joining watch flags it when it says it is ready (it was left in ``gone``: never taken
    in)."""
    engines, ts, addrs = world
    m = Membership(ts[0], LiveOps())
    other = ProgressEngine.thread(use_uvloop=False)

    async def take() -> list[int]:
        n = TcpTransport(2, 3, secret=SECRET)
        n.admit_rejoins = True
        await n.listen("tcp://127.0.0.1:0")
        got = await n.rejoin(addrs, timeout=10)
        other_t.append(n)
        return got

    other_t: list[TcpTransport] = []
    try:
        assert other.run_blocking(take()) == [0, 1]
        engines[0].run_blocking(asyncio.sleep(0.1))
        assert ts[0].vacant == set()
        assert ts[0].taken == {2}
        engines[0].call(lambda: m.watch(lambda: False))
        assert 2 not in m.gone
        assert m.grown == {2}
        job = Communicator(ts[0], progress=engines[0], survive=True)
        w = Joiners(job, "h")
        engines[0].call(lambda: w._ready.add(2))  # rank 2 said it is ready
        assert list(engines[0].call(lambda: w.flags([0, 1]))) == [0.0, 0.0, 1.0]
        engines[0].call(m.stop)
    finally:
        for n in other_t:
            other.run_blocking(n.close())
        other.close()


def test_a_group_closed_on_the_loop_gives_its_hold_back_when_its_parent_closes(
        world: Any) -> None:
    """A group closed on the runtime's loop (as inside ``comm.blocking.submit``) keeps its hold
    on the progress engine; its parent's ``await close()`` from a user loop gives it back, so
    the progress thread stops (it stayed alive until the interpreter exited)."""
    engines, ts, _ = world
    jobs = [Communicator(ts[r], progress=engines[r], survive=True) for r in range(2)]
    comms = [j.first_world(2) for j in jobs]
    groups: list[Any] = [None, None]

    def split(r: int) -> None:
        groups[r] = engines[r].run_blocking(comms[r].split(0, timeout=10))

    _both(split)

    def close_group(r: int) -> None:
        engines[r].run_blocking(groups[r].close())

    _both(close_group)

    def close(r: int) -> None:
        asyncio.run(comms[r].close())

    _both(close)
    assert all(j.closed for j in jobs)
    assert [e.closed for e in engines] == [True, True]
