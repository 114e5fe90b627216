"""The pool's wake-up figure: a message costs more at a rank that has been idle a while
(:attr:`asynccoll.sim.cost.Profile.wake_cpu`), and ``asynccoll sim calibrate`` fits it from a
ring of processes passing a token with and without idling first."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from asynccoll.sim import SimExecutor, SimWorld
from asynccoll.sim.calibrate import (
    RING_GAP,
    RING_RANKS,
    _ring,
    _shared_world,
    _sim_ring_pass,
    fit_wake,
)
from asynccoll.sim.cost import WAKE_FROM, WAKE_FULL, LinkClass, Profile, SharedCores

LINK = LinkClass(80e-6, 1 / 15e9)
POOLED = Profile("t", LinkClass(0.0, 1 / 4e9), LINK, gamma=5e-6, reduce_bps=10e9,
                 ranks_per_host=4, cores=2, call_overhead=60e-6, pool=True, msg_cpu=100e-6)


def test_wake_extra_ramps_from_nothing_to_the_figure() -> None:
    p = POOLED.with_(wake_cpu=100e-6)
    assert p.wake_extra(0.0) == 0.0
    assert p.wake_extra(WAKE_FROM) == 0.0
    mid = (WAKE_FROM + WAKE_FULL) / 2
    assert p.wake_extra(mid) == pytest.approx(50e-6)
    assert p.wake_extra(WAKE_FULL) == pytest.approx(100e-6)
    assert p.wake_extra(10.0) == pytest.approx(100e-6)
    assert POOLED.wake_extra(10.0) == 0.0  # not measured: nothing


def test_wake_figure_is_checked_and_kept_in_json() -> None:
    with pytest.raises(ValueError, match="wake_cpu"):
        POOLED.with_(wake_cpu=-1e-6)
    with pytest.raises(ValueError, match="wake_cpu"):
        SharedCores(alpha=1e-4, beta=1e-9, exit_gap=1e-4, wake_cpu=-1.0)
    p = POOLED.with_(wake_cpu=120e-6)
    assert Profile.from_json(p.to_json()) == p
    # an older profile's JSON (no field): no wake-up figure
    d = p.to_json()
    del d["wake_cpu"]
    assert Profile.from_json(d).wake_cpu == 0.0


def test_placed_pool_takes_the_fitted_wake_figure() -> None:
    sh = SharedCores(alpha=2e-4, beta=1 / 4e9, exit_gap=3e-4, world=4, msg_cpu=150e-6,
                     byte_cpu=1 / 2e9, wake_cpu=90e-6)
    prof = Profile("t", LINK, LINK, gamma=5e-6, reduce_bps=10e9, cores=2, shared=sh)
    assert Profile.from_json(prof.to_json()) == prof
    assert prof.placed(8).wake_cpu == 90e-6
    assert prof.placed(8).pooled
    assert prof.placed(8, "shared").wake_cpu == 0.0  # the scaled model has none
    assert prof.placed(2).wake_cpu == 0.0  # not oversubscribed: dedicated links


def _one_message(prof: Profile, send_at: float, post_at: float = 0.0,
                 data: bool = False) -> float:
    """Rank 1 starts (posts its receive: its first work) at ``post_at``, rank 0 sends at
    ``send_at``: how long after the send the receive completes."""
    from asynccoll.collectives import KERNELS
    from asynccoll.sched import Schedule, SlotSpec

    w = SimWorld(2, prof)
    done: dict[int, float] = {}
    slots = {"x": SlotSpec(1, "float32")} if data else None
    s0 = Schedule(0, 2, slots=slots)
    s0.send(1, "x" if data else None)
    s1 = Schedule(1, 2, slots=slots)
    s1.recv(0, "x" if data else None)
    for r, s, t0 in ((0, s0, send_at), (1, s1, post_at)):
        ex = SimExecutor(w, s.commit(), sched_id=1,
                         buffers={"x": np.zeros(1, np.float32)} if data else None,
                         kernels=KERNELS if data else None,
                         on_complete=lambda e, r=r: done.setdefault(r, w.now))
        w.at(t0, ex.start)
    w.run()
    return done[1] - send_at


@pytest.mark.parametrize("data", [False, True], ids=["timing", "data"])
@pytest.mark.parametrize("idle", [0.2e-3, 1.75e-3, 5e-3])
def test_a_receipt_at_an_idle_rank_pays_the_wake_up(idle: float, data: bool) -> None:
    prof = POOLED.with_(ranks_per_host=2, cores=1)
    cold = prof.with_(wake_cpu=100e-6)
    # the send's gamma and the receipt (gamma + msg_cpu) without it; the ramp's share with it
    base = _one_message(prof, idle, data=data)
    assert base == pytest.approx(2 * 5e-6 + 100e-6 + (4 / 4e9 if data else 0.0))  # 4 B
    got = _one_message(cold, idle, data=data)
    assert got - base == pytest.approx(cold.wake_extra(idle + 5e-6))
    assert (got > base) == (idle > WAKE_FROM)
    # without the pool (a rank per core) the figure is not used
    dedicated = cold.with_(ranks_per_host=1)
    assert _one_message(dedicated, idle, data=data) == \
        _one_message(prof.with_(ranks_per_host=1), idle, data=data)


@pytest.mark.parametrize("data", [False, True], ids=["timing", "data"])
@pytest.mark.parametrize("sent", [0.2e-3, 4e-3])
def test_a_held_message_is_priced_by_the_idle_when_it_came(sent: float, data: bool) -> None:
    # the message comes before rank 1 posts its receive (at 5 ms, its first work): its
    # receipt is booked then, but the wake-up is what rank 1's idle was when it came
    cold = POOLED.with_(ranks_per_host=2, cores=1, wake_cpu=100e-6)
    took = _one_message(cold, sent, post_at=5e-3, data=data) + sent
    assert took == pytest.approx(5e-3 + 5e-6 + 100e-6 + cold.wake_extra(sent + 5e-6)
                                 + (4 / 4e9 if data else 0.0))


def test_a_call_wakes_its_rank_as_a_message_does() -> None:
    from asynccoll.sim import Constant, simulate

    # two ranks on one core, a solo allreduce after idling 5 ms per step: with the figure each
    # call (and each receipt at the idle peer) costs more
    prof = POOLED.with_(ranks_per_host=2, cores=1)
    runs = [simulate("solo", 2, 4, profile=p, compute=Constant(5e-3), nbytes=4)
            for p in (prof, prof.with_(wake_cpu=100e-6))]
    assert (runs[1].latency > runs[0].latency + 100e-6 - 1e-9).all()


def test_the_simulated_ring_slows_after_idling_only_with_the_figure() -> None:
    cold = POOLED.with_(wake_cpu=100e-6)
    assert _sim_ring_pass(POOLED, RING_GAP) == pytest.approx(_sim_ring_pass(POOLED, 0.0))
    # back to back every rank waits less than WAKE_FROM: no wake-ups
    assert _sim_ring_pass(cold, 0.0) == pytest.approx(_sim_ring_pass(POOLED, 0.0))
    # after the gap rank 0's call and ranks 1-3's receipts each pay it all (rank 0's own
    # receipt, at the pass's end, less: it worked when the pass began)
    slower = _sim_ring_pass(cold, RING_GAP) - _sim_ring_pass(cold, 0.0)
    assert 4 * 100e-6 <= slower < 5 * 100e-6


@pytest.mark.parametrize("wake", [40e-6, 150e-6])
def test_fit_wake_recovers_the_figure_the_rings_came_from(wake: float) -> None:
    cold = POOLED.with_(wake_cpu=wake)
    got = fit_wake(POOLED, _sim_ring_pass(cold, 0.0), _sim_ring_pass(cold, RING_GAP))
    assert got == pytest.approx(wake, rel=1e-3)
    # a ring that did not slow down after idling: no figure
    assert fit_wake(POOLED, 700e-6, 690e-6) == 0.0


@pytest.mark.parametrize(("P", "ranks"), [(2, RING_RANKS), (4, RING_RANKS), (6, RING_RANKS),
                                          (6, 6), (8, 3)])
def test_ring_schedule_passes_through_its_first_ranks(P: int, ranks: int) -> None:
    n = min(ranks, P)
    scheds = [_ring(r, P, ranks) for r in range(P)]
    sends = {(r, op.peer) for r, s in enumerate(scheds) for op in s.ops if op.kind == "send"}
    assert sends == {(r, (r + 1) % n) for r in range(n)}
    recvs = {(r, op.peer) for r, s in enumerate(scheds) for op in s.ops if op.kind == "recv"}
    assert recvs == {(r, (r - 1) % n) for r in range(n)}
    assert all(op.kind == "nop" for s in scheds[n:] for op in s.ops)


@pytest.mark.parametrize(("world", "cores"), [(4, 2), (8, 4), (16, 8)])
def test_fit_wake_recovers_the_figure_on_larger_hosts(world: int, cores: int) -> None:
    # the ring passes through four ranks whatever the world: back to back none of them idles
    # past WAKE_FROM, so the fit stays monotone
    prof = POOLED.with_(ranks_per_host=world, cores=cores)
    cold = prof.with_(wake_cpu=120e-6)
    got = fit_wake(prof, _sim_ring_pass(cold, 0.0), _sim_ring_pass(cold, RING_GAP))
    assert got == pytest.approx(120e-6, rel=1e-6)
    assert fit_wake(prof, float("nan"), 1e-3) == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_time_shared_world_runs_the_rings_between_processes() -> None:
    # four real processes over tcp: barriers, allreduces, then the ring back to back and after
    # idling (a ring that lost its token would time out); every figure is a positive time, a
    # pass well under a second
    figs = _shared_world(4, "tcp", barriers=8, large=1 << 16, calls=3, rings=4, timeout=90)
    assert len(figs) == 5
    assert all(math.isfinite(f) and f > 0 for f in figs)
    ring, after_gap = figs[3], figs[4]
    assert ring < 1.0
    assert after_gap < ring + RING_GAP  # the idling itself is not in the timed pass


def test_calibrate_command_prints_the_wake_figure(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import asynccoll.sim.calibrate as cal
    from asynccoll.cli import main

    figs = {"call_overhead_us": 60.0, "pool_msg_cpu_us": 150.0, "pool_byte_cpu_GBps": 2.0,
            "pool_wake_cpu_us": 97.0}
    prof = Profile("local-tcp", LINK, LINK, gamma=5e-6, reduce_bps=10e9, cores=2,
                   figures=figs)
    monkeypatch.setattr(cal, "calibrate", lambda trs: {"tcp": prof})
    out = tmp_path / "p.json"
    assert main(["sim", "calibrate", "--transports", "tcp", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "150 us of CPU per message" in line
    assert "97 us more at a rank idle 3 ms" in line
    assert Profile.load(out) == prof
    # a profile calibrated before the figure existed prints without it
    del figs["pool_wake_cpu_us"]
    assert main(["sim", "calibrate", "--transports", "tcp", "--out", str(out)]) == 0
    assert "idle" not in capsys.readouterr().out
