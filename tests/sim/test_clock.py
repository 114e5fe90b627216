"""The simulator's clock: events by time, ties in scheduling order, whatever the queue's shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccoll.collectives.dense import barrier
from asynccoll.sched import Schedule, SlotSpec
from asynccoll.sim import LinkClass, Profile, SimExecutor, SimWorld

FAST = Profile("test", LinkClass(1e-6, 1e-12), LinkClass(1e-6, 1e-12), gamma=1e-7,
               reduce_bps=1e12)


def _world() -> tuple[SimWorld, list[Any]]:
    return SimWorld(2, FAST), []


@pytest.mark.timeout(10)
def test_ties_run_in_scheduling_order_and_later_ones_after() -> None:
    w, seen = _world()

    def note(x: Any) -> None:
        seen.append((w.now, x))
        if x == "a":
            w.at(1.0, note, "a-now")  # at the current time: after those already pending
            w.at(0.5, note, "a-past")  # in the past: clamped to now
            w.at(2.0, note, "a-later")

    w.at(2.0, note, "c")
    w.at(1.0, note, "a")
    w.at(1.0, note, "b")
    w.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "a-now"), (1.0, "a-past"), (2.0, "c"),
                    (2.0, "a-later")]
    assert w.events == 6
    assert w.idle


@pytest.mark.timeout(10)
def test_an_old_event_number_goes_before_the_newer_ones_of_its_time() -> None:
    # a deferred completion made an event keeps the number it was given
    w, seen = _world()
    q_first, q_old, q_new = next(w.seq), next(w.seq), next(w.seq)

    def first(_a: Any, _b: Any) -> None:
        seen.append("first")
        w.push(1.0, q_old, lambda a, b: seen.append("old"), None, None)

    w.push(1.0, q_first, first, None, None)
    w.push(1.0, q_new, lambda a, b: seen.append("new"), None, None)
    w.run()
    assert seen == ["first", "old", "new"]


@pytest.mark.timeout(10)
def test_until_and_max_events_resume_in_order() -> None:
    w, seen = _world()
    for i in range(6):
        w.at(float(i // 2), seen.append, i)  # two events per time
    w.run(max_events=3)
    assert seen == [0, 1, 2]
    w.run(until=1.5)
    assert seen == [0, 1, 2, 3]
    w.run(max_events=1)
    assert seen == [0, 1, 2, 3, 4]
    w.run()
    assert seen == list(range(6))
    assert w.events == 6
    assert w.idle


@pytest.mark.timeout(10)
def test_a_failing_event_is_dropped_and_the_rest_still_run() -> None:
    w, seen = _world()

    def boom() -> None:
        raise RuntimeError("boom")

    w.at(1.0, seen.append, "a")
    w.at(1.0, boom)
    w.at(1.0, seen.append, "b")
    w.at(2.0, seen.append, "c")
    with pytest.raises(RuntimeError, match="boom"):
        w.run()
    assert seen == ["a"]
    w.run()
    assert seen == ["a", "b", "c"]
    assert w.events == 4


@pytest.mark.timeout(10)
def test_messages_under_way_follow_a_replaced_endpoint() -> None:
    w = SimWorld(2, FAST)
    done: list[str] = []
    s0, s1 = barrier(0, 2), barrier(1, 2)
    SimExecutor(w, s0, sched_id=3, on_complete=lambda e: done.append("old 0"))
    ex1 = SimExecutor(w, s1, sched_id=3, on_complete=lambda e: done.append("1"))
    ex1.start()  # its message to rank 0 is under way
    new0 = SimExecutor(w, s0, sched_id=3, on_complete=lambda e: done.append("new 0"))
    w.at(1.0, new0.start)
    w.run()
    assert sorted(done) == ["1", "new 0"]
    assert w.dropped == 0


@pytest.mark.timeout(10)
def test_times_are_python_floats_whatever_at_is_given() -> None:
    # a NumPy scalar time would make every time derived from it one too (same values, ~10x
    # the cost per operation): at() converts
    w, seen = _world()
    w.at(np.float64(0.25), lambda: seen.append(type(w.now)))
    w.at(np.float32(0.5), lambda: seen.append(type(w.now)))
    w.run()
    assert seen == [float, float]
    assert w.now == 0.5


def _run(w: SimWorld, *exs: SimExecutor) -> None:
    for ex in exs:
        ex.start()
    w.run()


def _finish_times(w: SimWorld, scheds: list[Schedule], bufs: list[Any] | None = None,
                  kernels: Any = None) -> dict[int, float]:
    """Run one executor per rank (``scheds[r]`` committed here); when each completed."""
    done: dict[int, float] = {}
    exs = [SimExecutor(w, s.commit(), sched_id=1, buffers=None if bufs is None else bufs[r],
                       kernels=kernels, on_complete=lambda e, r=r: done.setdefault(r, w.now))
           for r, s in enumerate(scheds)]
    _run(w, *exs)
    return done


@pytest.mark.timeout(10)
def test_a_compute_op_s_successors_take_the_cpu_before_what_arrived_while_it_ran() -> None:
    # as the runtime's drain loop: a compute op runs inline, and the send it enables is fired
    # before the event loop reads what came in meanwhile. Rank 0 computes for 1 s, then sends;
    # rank 1's message reaches rank 0 while it computes.
    g, a = 1e-3, 1e-2
    prof = Profile("t", LinkClass(a, 0.0), LinkClass(a, 0.0), gamma=g, reduce_bps=4000.0)
    w = SimWorld(2, prof)
    s0 = Schedule(0, 2, slots={"x": SlotSpec(1000, "float32")})
    s0.recv(1, None, tag=1)
    c = s0.compute("sum", ["x", "x"], "x")
    s0.send(1, None, tag=2, deps=[c])
    s1 = Schedule(1, 2)
    s1.send(0, None, tag=1)
    s1.recv(0, None, tag=2)
    done = _finish_times(w, [s0, s1])
    work = g + 4000 / 4000.0  # the compute op: gamma plus its bytes at reduce_bps
    # rank 0's send leaves right after the compute op (one gamma), ahead of the receive
    assert done[1] == pytest.approx(work + g + a + g)
    # the receive (its message came at 2g + a) is done after the send
    assert done[0] == pytest.approx(work + g + g)
    assert w.events < 8


@pytest.mark.timeout(10)
def test_work_a_send_makes_ready_starts_once_its_bytes_are_out() -> None:
    # the send's completion is handled when it is posted; the compute op after it still
    # starts only when the interface has pushed the send's bytes (the op's floor)
    g, a, b = 1e-3, 1e-2, 1e-4
    prof = Profile("t", LinkClass(a, b), LinkClass(a, b), gamma=g, reduce_bps=4000.0)
    w = SimWorld(2, prof)
    s0 = Schedule(0, 2, slots={"x": SlotSpec(1000, "float32")})
    snd = s0.send(1, "x", tag=1)
    s0.compute("sum", ["x", "x"], "x", deps=[snd])
    s1 = Schedule(1, 2, slots={"x": SlotSpec(1000, "float32")})
    s1.recv(0, "x", tag=1)
    done = _finish_times(w, [s0, s1])
    out = g + 4000 * b  # the send's CPU, then its bytes through the interface
    assert done[1] == pytest.approx(out + a + g)
    assert done[0] == pytest.approx(out + g + 4000 / 4000.0)


@pytest.mark.timeout(10)
def test_the_cpu_is_free_for_other_work_while_a_send_s_bytes_go_out() -> None:
    # rank 0: a big send (bytes out at about 0.4 s) and a small compute op after it, and an
    # unrelated receive (its message at about 0.011 s) followed by a hooked op: the receive is
    # served at once, not after the compute op that waits for the send
    g, a, b = 1e-3, 1e-2, 1e-6
    prof = Profile("t", LinkClass(a, b), LinkClass(a, b), gamma=g, reduce_bps=4e9)
    n = 100_000
    s0 = Schedule(0, 3, slots={"big": SlotSpec(n, "float32"), "y": SlotSpec(4, "float32")})
    snd = s0.send(2, "big", tag=1)
    c = s0.compute("sum", ["y", "y"], "y", deps=[snd])
    r = s0.recv(1, None, tag=2)
    h = s0.compute("copy", ["y"], "y", deps=[r])
    s0.final = s0.nop(deps=[c, h])
    s1 = Schedule(1, 3)
    s1.send(0, None, tag=2)
    s2 = Schedule(2, 3, slots={"big": SlotSpec(n, "float32")})
    s2.recv(0, "big", tag=1)
    w = SimWorld(3, prof)
    seen: dict[str, float] = {}
    ex0 = SimExecutor(w, s0.commit(), sched_id=1,
                      hooks={"copy": lambda rank, e, op: seen.setdefault("ping", w.now)},
                      on_complete=lambda e: seen.setdefault("done", w.now))
    _run(w, ex0, SimExecutor(w, s1.commit(), sched_id=1),
         SimExecutor(w, s2.commit(), sched_id=1))
    assert seen["ping"] == pytest.approx(g + a + g)  # its send, the wire, its receive
    assert seen["done"] == pytest.approx(g + 4 * n * b + g + 16 / 4e9)


@pytest.mark.timeout(10)
def test_a_k_of_n_op_is_fired_by_the_dependency_that_is_due_first() -> None:
    # copy(tmp -> y) needs 1 of {a big send, a receive of 7s}: the receive is done long before
    # the send's bytes are out, so it fires the copy, with its data
    from asynccoll.collectives import KERNELS

    g, a, b = 1e-3, 1e-2, 1e-6
    prof = Profile("t", LinkClass(a, b), LinkClass(a, b), gamma=g, reduce_bps=4e9)
    n = 100_000
    s0 = Schedule(0, 3, slots={"big": SlotSpec(n, "float32"), "tmp": SlotSpec(4, "float32"),
                               "y": SlotSpec(4, "float32")})
    snd = s0.send(2, "big", tag=1)
    r = s0.recv(1, "tmp", tag=2)
    cp = s0.compute("copy", ["tmp"], "y", deps=[snd, r], k=1)
    s0.final = s0.nop(deps=[cp])
    s1 = Schedule(1, 3, slots={"tmp": SlotSpec(4, "float32")})
    s1.send(0, "tmp", tag=2)
    s2 = Schedule(2, 3, slots={"big": SlotSpec(n, "float32")})
    s2.recv(0, "big", tag=1)
    bufs = [{k: np.zeros(v.count or 0, "float32") for k, v in s.slots.items()}
            for s in (s0, s1, s2)]
    bufs[1]["tmp"][:] = 7
    done = _finish_times(SimWorld(3, prof), [s0, s1, s2], bufs, KERNELS)
    assert bufs[0]["y"].tolist() == [7.0] * 4
    assert done[0] < 0.05  # not at the send's 0.4 s


@pytest.mark.timeout(10)
def test_no_op_fires_ahead_of_its_time_for_an_execution_that_ends_first() -> None:
    # rank 0 computes until 0.15 s, then completes; a receive's message comes meanwhile and
    # its completion (after the CPU is free) is past the end of the execution: its successor
    # send must not go out for the finished execution (rank 1 would refuse it)
    g, a, b = 1e-3, 0.01, 1e-6
    prof = Profile("t", LinkClass(a, b), LinkClass(a, b), gamma=g, reduce_bps=4e5)
    s0 = Schedule(0, 3, slots={"big": SlotSpec(15_000, "float32")})
    x = s0.compute("sum", ["big", "big"], "big")
    r = s0.recv(1, None, tag=2)
    s0.send(1, None, tag=3, deps=[r])
    s0.final = s0.nop(deps=[x])
    s1 = Schedule(1, 3)
    s1.send(0, None, tag=2)
    s2 = Schedule(2, 3)
    s2.nop()
    w = SimWorld(3, prof)
    # raised SimulationError (a data message for a completed execution)
    done = _finish_times(w, [s0, s1, s2])
    assert done[0] == pytest.approx(g + 60_000 / 4e5)
    assert w.messages == 1
