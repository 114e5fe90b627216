"""Adversarial tests of sub-communicators and survival (``split``, ``group``, ``shrink``,
``Membership.agree``, surviving partial handles).

Two halves:

* **Logic**, over :func:`asynccoll.testing.local_world` (loopback tcp, one process): a rank is
  "lost" by closing its transport without a goodbye, so the others see its connection end.
  Concurrent ``shrink``; two surviving handles that recover at once or in different orders;
  a survivor that comes to the agreement after the coordinator decided and died; malformed
  frames on the agreement's reserved channels; odd ``split`` colors/keys and ``group`` ranks;
  a group used after its parent closed.
* **Losses**, real processes over loopback tcp SIGKILLed mid-run (as
  ``tests/adversarial/test_survival.py``): a non-member's loss, a loss while the others flush,
  survival of ``two_choice``/``deadline`` handles and of ``op="max"`` without ``accumulate``,
  and a coordinator SIGKILLed during the agreement itself.

Each case that revealed a bug in review is kept here, now passing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import run_killed_job

import asynccoll
from asynccoll import Accumulate, Solo
from asynccoll.comm.membership import AGREE_ANSWER, AGREE_ASK, AGREE_DECIDE
from asynccoll.errors import ProtocolError
from asynccoll.testing import local_world
from asynccoll.transport.frames import Kind

ROOT = str(Path(__file__).parents[2])


async def _lose(c: asynccoll.Communicator) -> None:
    """Make ``c``'s rank lost to the others: its connections end without a goodbye."""
    await c._engine.run(c.transport.close())
    await asyncio.sleep(0.3)  # the others see it (and tell each other)


def _fast(cs: list[asynccoll.Communicator], survive: bool = False) -> None:
    for c in cs:
        c.close_timeout = 1.0  # a lost rank's peers do not wait 30 s for its goodbye
        c.survive = survive


def _send(c: asynccoll.Communicator, dst: int, sched: int, execution: int,
          payload: bytes) -> None:
    """A raw frame from ``c``'s rank on a reserved channel (an adversarial peer)."""
    t = c.transport
    c._engine.call(lambda: t.post_frame(dst, int(Kind.DATA), sched, execution, 0,
                                        memoryview(payload)))


# -- shrink ----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_shrink_of_a_world_of_one_is_itself_again() -> None:
    async with local_world(1, "tcp") as cs:
        g = await cs[0].shrink()
        assert g.members == (0,)
        assert g.size == 1
        assert await cs[0].shrink() is g
        assert np.array_equal(await g.allreduce(np.ones(3)), np.ones(3))


@pytest.mark.timeout(30)
async def test_shrink_without_a_loss_keeps_everyone() -> None:
    async with local_world(3, "tcp", timeout=5) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.shrink() for c in cs))
        assert [g.members for g in gs] == [(0, 1, 2)] * 3
        got = await asyncio.gather(*(g.allreduce(np.full(2, g.rank + 1.0)) for g in gs))
        assert all(np.array_equal(x, [6.0, 6.0]) for x in got)


@pytest.mark.timeout(30)
async def test_shrink_called_concurrently_from_two_tasks() -> None:
    async with local_world(3, "tcp", timeout=5) as cs:
        _fast(cs)
        await _lose(cs[2])

        async def twice(c: asynccoll.Communicator) -> list[Any]:
            return await asyncio.gather(c.shrink(2), c.shrink(2), return_exceptions=True)

        got = await asyncio.gather(twice(cs[0]), twice(cs[1]))
        for a, b in got:
            assert isinstance(a, asynccoll.Communicator), a
            assert b is a, b


@pytest.mark.timeout(30)
async def test_late_survivor_after_the_coordinator_decided_and_died() -> None:
    async with local_world(4, "tcp", timeout=5) as cs:
        _fast(cs)
        await _lose(cs[3])
        g0, g1 = await asyncio.gather(cs[0].shrink(3), cs[1].shrink(3))
        assert g0.members == g1.members == (0, 1, 2)
        await _lose(cs[0])  # the coordinator dies after deciding; rank 2 has not shrunk
        assert {0, 3} <= cs[2].membership.gone
        g2 = await cs[2].shrink(3)  # must not hang: rank 1 holds the decision
        assert g2.members == (0, 1, 2)  # the decision stands; the next shrink drops 0


@pytest.mark.timeout(30)
async def test_shrink_after_a_split_that_completed_on_some_survivors_only() -> None:
    # messages into rank 1 take 0.6 s: rank 0's split completes, rank 1's cannot before the
    # loss of rank 2
    async with local_world(3, "inproc", timeout=5,
                           link_delay={(0, 1): 0.6, (2, 1): 0.6}) as cs:
        _fast(cs)
        await asyncio.gather(*(c.split(None) for c in cs))  # the allgather's schedule, agreed
        tasks = [asyncio.ensure_future(c.split(0)) for c in cs]
        await asyncio.wait_for(asyncio.shield(tasks[0]), 5)  # rank 0's split completed
        assert not tasks[1].done()
        await cs[2]._engine.run(cs[2].transport.close())  # rank 2 lost
        with pytest.raises(asynccoll.PeerLostError):
            await tasks[1]
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)
        gs = await asyncio.gather(cs[0].shrink(3), cs[1].shrink(3))
        assert [g.members for g in gs] == [(0, 1)] * 2
        got = await asyncio.gather(*(g.allreduce(np.ones(1), timeout=2) for g in gs))
        assert all(np.array_equal(x, [2.0]) for x in got)


# -- the agreement's reserved channels -------------------------------------------------------
@pytest.mark.timeout(30)
async def test_a_flood_of_agreement_questions_breaks_nothing() -> None:
    async with local_world(3, "tcp", timeout=5) as cs:
        _fast(cs)
        for _ in range(500):
            _send(cs[1], 0, AGREE_ASK, 1, b"garbage-of-13")
            _send(cs[1], 0, AGREE_ASK, 7, b"")  # an execution nobody listens to
        await asyncio.sleep(0.3)
        got = await asyncio.gather(*(c.allreduce(np.ones(2)) for c in cs))
        assert all(np.array_equal(x, [3.0, 3.0]) for x in got)
        assert all(c.lost is None for c in cs)


@pytest.mark.timeout(30)
async def test_a_misaligned_agreement_answer_is_a_protocol_error() -> None:
    async with local_world(3, "tcp", timeout=3) as cs:
        _fast(cs)
        await _lose(cs[2])
        _send(cs[1], 0, AGREE_ANSWER, 0, b"abc")  # before rank 0 even asks
        await asyncio.sleep(0.1)
        with pytest.raises(ProtocolError, match="3 bytes"):
            await cs[0].shrink(2)


@pytest.mark.timeout(30)
async def test_an_empty_agreement_answer_is_a_protocol_error() -> None:
    async with local_world(3, "tcp", timeout=3) as cs:
        _fast(cs)
        await _lose(cs[2])
        _send(cs[1], 0, AGREE_ANSWER, 0, b"")
        await asyncio.sleep(0.1)
        with pytest.raises(ProtocolError):
            await cs[0].shrink(2)


@pytest.mark.timeout(30)
async def test_a_misaligned_decision_is_a_protocol_error() -> None:
    async with local_world(3, "tcp", timeout=3) as cs:
        _fast(cs)
        await _lose(cs[2])
        _send(cs[0], 1, AGREE_DECIDE, 0, b"abcde")
        await asyncio.sleep(0.1)
        with pytest.raises(ProtocolError, match="5 bytes"):
            await cs[1].shrink(2)
        # the coordinator itself is not hurt
        g0 = await cs[0].shrink(2)
        assert g0.members == (0, 1)


# -- groups and losses -----------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_a_non_members_loss_leaves_the_group_working() -> None:
    async with local_world(3, "tcp", timeout=5) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([0, 1]) for c in cs))
        assert gs[2] is None
        await _lose(cs[2])
        for step in range(3):
            got = await asyncio.gather(*(g.allreduce(np.full(2, step + 1.0)) for g in gs[:2]))
            assert all(np.array_equal(x, np.full(2, 2.0 * (step + 1))) for x in got)
        assert gs[0].lost is None
        assert gs[1].lost is None
        for c in cs[:2]:
            with pytest.raises(asynccoll.PeerLostError) as ei:
                await c.allreduce(np.ones(2))
            assert ei.value.rank == 2
        # a group cannot be made from the parent after the loss: shrink first
        with pytest.raises(asynccoll.PeerLostError):
            await cs[0].group([0, 1])


@pytest.mark.timeout(30)
async def test_a_members_loss_is_reported_under_its_group_rank() -> None:
    async with local_world(4, "tcp", timeout=5) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([3, 1, 0]) for c in cs))  # parent 0 = group 2
        await _lose(cs[0])
        for g in (gs[1], gs[3]):
            with pytest.raises(asynccoll.PeerLostError) as ei:
                await g.allreduce(np.ones(2))
            assert ei.value.rank == 2
        s = await asyncio.gather(gs[1].shrink(3), gs[3].shrink(3))
        assert [x.members for x in s] == [(3, 1)] * 2  # job ranks, in the group's order
        got = await asyncio.gather(*(x.allreduce(np.ones(2)) for x in s))
        assert all(np.array_equal(x, [2.0, 2.0]) for x in got)


@pytest.mark.timeout(30)
async def test_a_group_after_its_parent_closed_raises_at_once() -> None:
    async with local_world(2, "tcp", timeout=5) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([1, 0]) for c in cs))
        await asyncio.gather(*(c.close() for c in cs))
        for g in gs:
            assert g.closed
            with pytest.raises(asynccoll.TransportClosedError):
                await asyncio.wait_for(g.allreduce(np.ones(2)), 5)
            with pytest.raises(asynccoll.TransportClosedError):
                g.partial_allreduce(Solo(), like=np.ones(2))
            with pytest.raises(asynccoll.TransportClosedError):
                await g.shrink()


@pytest.mark.timeout(30)
async def test_a_group_left_on_an_exception_is_a_loss_to_its_members() -> None:
    async with local_world(3, "tcp", timeout=4) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([0, 1]) for c in cs))

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with gs[0]:
                raise Boom
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(asynccoll.PeerLostError):
            await gs[1].allreduce(np.ones(2))
        assert loop.time() - t0 < 2.0
        # the parent is not concerned
        got = await asyncio.gather(*(c.allreduce(np.ones(1)) for c in cs))
        assert all(np.array_equal(x, [3.0]) for x in got)


# -- split and group arguments ---------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_split_with_negative_and_huge_keys_orders_by_key() -> None:
    async with local_world(3, "inproc", timeout=5) as cs:
        keys = {0: 2**62, 1: -(10**18), 2: -5}
        gs = await asyncio.gather(*(c.split(2**62, keys[c.rank]) for c in cs))
        assert [g.members for g in gs] == [(1, 2, 0)] * 3
        assert [g.rank for g in gs] == [2, 0, 1]
        ks = await asyncio.gather(*(c.split(np.int64(7), np.int32(0)) for c in cs))
        assert [g.members for g in ks] == [(0, 1, 2)] * 3  # ties: by parent rank


@pytest.mark.timeout(30)
async def test_split_with_a_key_beyond_int64_names_the_key() -> None:
    async with local_world(2, "inproc", timeout=3) as cs:
        got = await asyncio.gather(*(c.split(0, 2**64) for c in cs), return_exceptions=True)
        for e in got:
            assert isinstance(e, (ValueError, TypeError)), e
            assert "key" in str(e), e
        got = await asyncio.gather(*(c.split(2**63, 0) for c in cs), return_exceptions=True)
        for e in got:
            assert isinstance(e, (ValueError, TypeError)), e
            assert "color" in str(e), e


@pytest.mark.timeout(30)
async def test_group_takes_numpy_ints() -> None:
    async with local_world(3, "inproc", timeout=5) as cs:
        gs = await asyncio.gather(*(c.group(np.array([2, 0], np.int32)) for c in cs))
        assert gs[1] is None
        assert gs[0].members == gs[2].members == (2, 0)
        hs = await asyncio.gather(*(c.group([np.int64(1), np.uint8(0)]) for c in cs))
        assert hs[0].members == (1, 0)
        assert hs[2] is None


@pytest.mark.timeout(30)
async def test_group_refuses_float_and_numpy_bool_ranks() -> None:
    async with local_world(2, "inproc", timeout=5) as cs:
        for bad in ([1.7, 0], [np.True_, 0]):
            got = await asyncio.gather(*(c.group(bad) for c in cs), return_exceptions=True)
            assert all(isinstance(e, TypeError) for e in got), (bad, got)


# -- surviving handles (logic) ---------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_a_handle_made_after_the_loss_goes_on_without_it() -> None:
    # (before, creation raised PeerLostError until shrink; a surviving handle made after the
    # loss now takes part in the recovery, even called one rank after the other)
    async with local_world(3, "tcp", timeout=5) as cs:
        _fast(cs, survive=True)
        await _lose(cs[2])
        late = [c.partial_allreduce(Solo(), like=np.ones(2), accumulate=Accumulate.SUM)
                for c in cs[:2]]
        got = [await h(np.ones(2), timeout=10) for h in late]
        fl = await asyncio.gather(*(h.flush(timeout=10) for h in late))
        for r, f in zip(got, fl, strict=True):
            assert r.lost == frozenset({2})
            assert r.world_size == 2
            assert np.array_equal(r.value + f.value, [2.0, 2.0])
        # a communicator made after the loss raises until shrink (synchronous collectives)
        with pytest.raises(asynccoll.PeerLostError):
            cs[0].partial_allreduce(Solo(), like=np.ones(2), survive=False)
        gs = await asyncio.gather(cs[0].shrink(3), cs[1].shrink(3))
        hs = [g.partial_allreduce(Solo(), like=np.ones(2), accumulate=Accumulate.SUM) for g in gs]
        acc = [(await h(np.ones(2))).value for h in hs]
        fl = await asyncio.gather(*(h.flush() for h in hs))
        assert all(np.array_equal(a + f.value, [2.0, 2.0]) for a, f in zip(acc, fl, strict=True))


@pytest.mark.timeout(30)
async def test_two_surviving_handles_recover_at_once() -> None:
    async with local_world(3, "tcp", timeout=4) as cs:
        _fast(cs, survive=True)
        x = np.ones(4)
        ha = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="a") for c in cs]
        hb = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="b") for c in cs]
        await asyncio.gather(*(h(x) for h in ha), *(h(x) for h in hb))
        await _lose(cs[2])
        got = await asyncio.gather(*(h(x) for h in (*ha[:2], *hb[:2])),
                                   return_exceptions=True)
        for r in got:
            assert isinstance(r, asynccoll.PartialResult), r
            assert r.lost == frozenset({2})
            assert r.world_size == 2


@pytest.mark.timeout(30)
async def test_two_surviving_handles_called_in_different_orders() -> None:
    async with local_world(3, "tcp", timeout=3) as cs:
        _fast(cs, survive=True)
        x = np.ones(4)
        ha = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="a") for c in cs]
        hb = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="b") for c in cs]
        await _lose(cs[2])

        async def in_order(first: Any, second: Any) -> list[Any]:
            return [await first(x), await second(x)]

        got = await asyncio.gather(in_order(ha[0], hb[0]), in_order(hb[1], ha[1]),
                                   return_exceptions=True)
        for r in got:
            assert isinstance(r, list), r
            assert all(v.lost == frozenset({2}) for v in r)


@pytest.mark.timeout(30)
async def test_a_handle_idle_across_two_losses_recovers() -> None:
    async with local_world(4, "tcp", timeout=3) as cs:
        _fast(cs, survive=True)
        x = np.ones(2)
        ha = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="a") for c in cs]
        hb = [c.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="b") for c in cs]
        await _lose(cs[3])
        got = await asyncio.gather(*(h(x) for h in ha[:3]))  # a recovers, b stays idle
        assert all(r.lost == frozenset({3}) for r in got)
        await _lose(cs[2])
        got = await asyncio.gather(*(h(x) for h in ha[:2]))  # a: fine again
        assert all(r.lost == frozenset({2, 3}) for r in got)
        got = await asyncio.gather(*(h(x) for h in hb[:2]), return_exceptions=True)
        for r in got:
            assert isinstance(r, asynccoll.PartialResult), r
            assert r.lost == frozenset({2, 3})
            assert r.world_size == 2


@pytest.mark.timeout(30)
async def test_a_loss_reaches_a_group_of_a_group_under_its_own_rank() -> None:
    async with local_world(4, "tcp", timeout=3) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([3, 2, 1]) for c in cs))
        hs = await asyncio.gather(*(g.group([2, 0]) for g in gs[1:]))  # job ranks 1, 3
        assert hs[0].members == hs[2].members == (1, 3)
        assert hs[1] is None
        await _lose(cs[3])
        with pytest.raises(asynccoll.PeerLostError) as ei:
            await hs[0].allreduce(np.ones(2))
        assert ei.value.rank == 1  # job rank 3 is rank 1 of the innermost group


@pytest.mark.timeout(30)
async def test_split_none_everywhere_makes_no_group() -> None:
    async with local_world(3, "inproc", timeout=3) as cs:
        assert await asyncio.gather(*(c.split(None) for c in cs)) == [None] * 3
        gs = await asyncio.gather(*(c.split(0 if c.rank else None) for c in cs))
        assert gs[0] is None
        assert gs[1].members == gs[2].members == (1, 2)
        got = await asyncio.gather(gs[1].allreduce(np.ones(1)), gs[2].allreduce(np.ones(1)))
        assert all(np.array_equal(x, [2.0]) for x in got)


# -- real processes, real losses -------------------------------------------------------------
RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll

def die():
    os.kill(os.getpid(), signal.SIGKILL)

async def nonmember(comm, kill):
    g = await comm.group([0, 1])
    out = {}
    if comm.rank == 2:
        await asyncio.sleep(0.3)
        die()
    if g is None:
        return out
    sums = []
    for step in range(40):
        sums.append(float((await g.allreduce(np.full(2, comm.rank + 1.0)))[0]))
        await asyncio.sleep(0.02)
    try:
        await comm.allreduce(np.ones(2))
    except asynccoll.PeerLostError as exc:
        out["parent_raised"] = exc.rank
    out.update(sums=sums, group_lost=g.lost is not None)
    await g.close()
    return out

async def flushing(comm, kill):
    x = np.full(4, 1000.0 ** comm.rank)
    h = comm.partial_allreduce("solo", like=x, accumulate="sum")
    acc, calls = np.zeros(4), 0
    for step in range(6):
        await asyncio.sleep(0.002 * (comm.rank + 1))
        acc += (await h(x)).value
        calls += 1
    if comm.rank in kill:
        await asyncio.sleep(0.8)  # the others are inside flush() by now
        die()
    f = await h.flush()
    acc += f.value
    return {"acc": acc.tolist(), "calls": calls, "lost": sorted(f.lost),
            "size": f.world_size}

async def kinds(comm, kill, kind, op, accumulate):
    x = np.full(4, comm.rank + 1.0) if op == "max" else np.full(4, 1000.0 ** comm.rank)
    policy = asynccoll.Deadline(bounds=0.05) if kind == "deadline" else kind
    h = comm.partial_allreduce(policy, like=x, op=op,
                               accumulate="sum" if accumulate else "latest")
    acc, calls, lost, sizes, vals = np.zeros(4), 0, set(), set(), []
    for step in range(16):
        if comm.rank in kill and step == 5:
            die()
        await asyncio.sleep(0.002 * (comm.rank + 1))
        r = await h(x)
        calls += 1
        acc += r.value
        vals.append([float(r.value[0]), r.world_size, r.count])
        lost |= set(r.lost)
        sizes.add(r.world_size)
    f = await h.flush()
    acc += f.value
    return {"acc": acc.tolist(), "calls": calls, "lost": sorted(lost | set(f.lost)),
            "sizes": sorted(sizes), "vals": vals, "final": float(f.value[0]),
            "final_size": f.world_size}

async def coordinator(comm, kill):
    x = np.ones(8)
    out = {}
    try:
        for step in range(10_000):
            if comm.rank == kill[0] and step == 3:
                die()
            await comm.allreduce(x)
    except asynccoll.PeerLostError as exc:
        out["caught"] = exc.rank
    if comm.rank in kill[1:]:
        # the coordinator of the agreement dies while it runs
        loop = asyncio.get_running_loop()
        loop.call_later(0.002, die)
    g, shrinks = comm, 0
    while True:
        g = await g.shrink(10)
        shrinks += 1
        try:
            s = await g.allreduce(np.full(2, comm.rank + 1.0))
            break
        except asynccoll.PeerLostError:
            if shrinks > 3:
                raise
    out.update(members=list(g.members), sum=s.tolist(), shrinks=shrinks)
    await g.close()
    return out

async def main():
    out, what, kill = sys.argv[1], sys.argv[2], [int(k) for k in sys.argv[3].split(",")]
    test, *args = what.split(":")
    comm = await asynccoll.connect(timeout=60, collective_timeout=10, survive=True)
    comm.close_timeout = 2.0
    async with comm:
        if test == "kinds":
            kind, op, accumulate = args
            res = await kinds(comm, kill, kind, op, accumulate == "1")
        else:
            res = await globals()[test](comm, kill)
    with open(f"{out}/rank-{comm.rank}.json", "w") as f:
        json.dump(res, f)

asyncio.run(main())
"""


def _run(tmp_path: Path, what: str, kill: str, P: int) -> dict[int, Any]:
    return run_killed_job(tmp_path, RANK, P, [str(tmp_path), what, kill], kill, timeout=25)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_sigkilled_non_member_leaves_the_group_running(tmp_path: Path) -> None:
    got = _run(tmp_path, "nonmember", "2", 3)
    for o in got.values():
        assert o["sums"] == [3.0] * 40
        assert o["parent_raised"] == 2
        assert not o["group_lost"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_loss_while_the_survivors_flush(tmp_path: Path) -> None:
    got = _run(tmp_path, "flushing", "3", 4)
    counts = None
    for r, o in got.items():
        acc = np.array(o["acc"])
        assert (acc == acc[0]).all()
        n = [(int(acc[0]) // 1000 ** q) % 1000 for q in range(4)]
        for q in got:
            assert n[q] == got[q]["calls"], (r, q, n)  # each survivor's calls exactly once
        assert n[3] <= 6
        counts = counts or n
        assert n == counts, "the survivors disagree on what was counted"
        assert o["lost"] == [3]
        assert o["size"] == 3


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["two_choice", "deadline"])
def test_two_choice_and_deadline_handles_survive(tmp_path: Path, kind: str) -> None:
    got = _run(tmp_path, f"kinds:{kind}:sum:1", "3", 4)
    counts = None
    for r, o in got.items():
        acc = np.array(o["acc"])
        n = [(int(acc[0]) // 1000 ** q) % 1000 for q in range(4)]
        for q in got:
            assert n[q] == got[q]["calls"], (r, q, n)
        counts = counts or n
        assert n == counts
        assert o["lost"] == [3]
        assert o["final_size"] == 3
        assert 3 in o["sizes"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_max_without_accumulate_survives(tmp_path: Path) -> None:
    got = _run(tmp_path, "kinds:solo:max:0", "3", 4)
    for o in got.values():
        assert o["lost"] == [3]
        assert o["final_size"] == 3
        after = 0
        for v, size, count in o["vals"]:
            # an execution nobody contributed to is max's identity, as without a loss
            assert v in (1.0, 2.0, 3.0, 4.0) if count else v == -np.inf, o["vals"]
            if size == 3:
                after += 1
                if after > 1:  # the first may be the settled execution, 4 in it
                    assert v <= 3.0, o["vals"]  # after the loss nobody contributes 4
        assert o["final"] <= 3.0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_coordinator_sigkilled_during_the_agreement(tmp_path: Path) -> None:
    # rank 4 dies first; rank 0, the agreement's coordinator, dies 2 ms into it
    got = _run(tmp_path, "coordinator", "4,0", 5)
    for o in got.values():
        assert o["members"] == [1, 2, 3], o
        assert o["sum"] == [9.0, 9.0]


# -- the launcher's --max-failures -----------------------------------------------------------
LAUNCHED = """
import asyncio, os, sys, numpy as np, asynccoll

async def main():
    comm = await asynccoll.connect(collective_timeout=10)
    async with comm:
        x = np.ones(8)
        try:
            for step in range(10_000):
                if comm.rank == 1 and step == 3:
                    os.kill(os.getpid(), 40)  # a realtime signal: terminates, no enum name
                await comm.allreduce(x)
        except asynccoll.PeerLostError:
            pass
        g = await comm.shrink(10)
        s = await g.allreduce(np.ones(2))
        print("survivors", g.size, "sum", s[0], flush=True)
        await g.close()

asyncio.run(main())
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_max_failures_with_a_rank_killed_by_a_realtime_signal(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "3",
                        "--max-failures", "1", str(script)], capture_output=True, text=True,
                       timeout=25, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 1 was killed by" in p.stderr
    assert p.stdout.count("survivors 2 sum 2.0") == 2, p.stdout


# -- clocks ----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_sync_clocks_on_a_group_and_with_mismatched_rounds() -> None:
    async with local_world(3, "tcp", timeout=3) as cs:
        _fast(cs)
        gs = await asyncio.gather(*(c.group([2, 1]) for c in cs))
        offs = await asyncio.gather(gs[2].sync_clocks(3), gs[1].sync_clocks(3))
        assert offs[0] == 0.0  # group rank 0 (job rank 2) is the group's reference
        assert abs(offs[1]) < 0.05
        # ranks that disagree on rounds: the pingers time out (a bare TimeoutError); the
        # communicator still works afterwards
        got = await asyncio.gather(*(c.sync_clocks(2 if c.rank == 0 else 4, timeout=1)
                                     for c in cs), return_exceptions=True)
        assert got[0] == 0.0
        assert all(isinstance(e, TimeoutError) for e in got[1:]), got
        got = await asyncio.gather(*(c.allreduce(np.ones(1)) for c in cs))
        assert all(np.array_equal(x, [3.0]) for x in got)
