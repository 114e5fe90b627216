"""The time-shared cores' part of the cost model: placement, exit waves, the pool of cores, and
the fits that ``asynccoll sim calibrate`` makes of them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from asynccoll.collectives import KERNELS
from asynccoll.sched import Schedule, SlotSpec
from asynccoll.sim import SimExecutor, SimWorld
from asynccoll.sim.calibrate import (
    _sim_allreduce_period,
    _sim_barrier_period,
    fit_pool,
    fit_shared,
)
from asynccoll.sim.cost import LinkClass, Profile, SharedCores

LINK = LinkClass(80e-6, 1 / 15e9)
SHARED = SharedCores(alpha=200e-6, beta=1 / 4e9, exit_gap=300e-6, world=4)
PROF = Profile("t", LINK, LINK, gamma=5e-6, reduce_bps=10e9, cores=2, call_overhead=60e-6,
               shared=SHARED)


def test_json_round_trip_keeps_shared() -> None:
    assert Profile.from_json(PROF.to_json()) == PROF
    bare = PROF.with_(shared=None)
    assert Profile.from_json(bare.to_json()) == bare


def test_placed_uses_shared_figures_only_when_oversubscribed() -> None:
    two = PROF.placed(2)
    assert two.intra == LINK
    assert two.exit_gap == 0.0
    assert not two.exit_offsets(3, 2, np.random.default_rng(0)).any()
    eight = PROF.placed(8)
    assert eight.intra == LinkClass(SHARED.alpha, SHARED.beta)
    assert eight.cpu_scale == 4.0
    assert eight.exit_gap == SHARED.exit_gap
    assert eight.call_overhead == PROF.call_overhead
    # without shared figures, placing is setting ranks_per_host
    assert PROF.with_(shared=None).placed(8) == PROF.with_(shared=None, ranks_per_host=8)


def test_exit_offsets_are_waves_of_cores() -> None:
    off = PROF.placed(8).exit_offsets(5, 8, np.random.default_rng(1))
    assert off.shape == (5, 8)
    for row in off:
        # 8 ranks on 2 cores: 4 waves of 2, exit_gap apart, in a random order
        assert sorted(np.round(row / SHARED.exit_gap).astype(int).tolist()) == \
            [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({tuple(r) for r in off}) > 1
    # two hosts of 4: each host's ranks leave in their own waves
    two_hosts = PROF.with_(ranks_per_host=4).exit_offsets(1, 8, np.random.default_rng(2))[0]
    for host in (two_hosts[:4], two_hosts[4:]):
        assert sorted(np.round(host / SHARED.exit_gap).astype(int).tolist()) == [0, 0, 1, 1]


def test_fit_shared_recovers_the_link_the_periods_came_from() -> None:
    # periods the simulator itself gives for known shared figures: the fit must find them
    placed = PROF.placed(4)
    bar = _sim_barrier_period(placed)
    big = _sim_allreduce_period(placed, 4 << 20)
    fit = fit_shared(PROF.with_(shared=None), 4, bar, big, 4 << 20, SHARED.exit_gap)
    assert fit.alpha == pytest.approx(SHARED.alpha, rel=1e-3)
    assert fit.beta == pytest.approx(SHARED.beta, rel=1e-3)
    assert fit.exit_gap == SHARED.exit_gap
    assert fit.world == 4


def test_shared_cores_rejects_negative_figures() -> None:
    with pytest.raises(ValueError, match="exit_gap"):
        SharedCores(1e-4, 1e-10, -1.0)


POOL = SharedCores(alpha=200e-6, beta=1 / 4e9, exit_gap=300e-6, world=4, msg_cpu=150e-6,
                   byte_cpu=1 / 6e9)


def test_placed_takes_the_pool_where_it_was_fitted() -> None:
    prof = PROF.with_(shared=POOL)
    assert Profile.from_json(prof.to_json()) == prof
    eight = prof.placed(8)
    assert eight.pooled
    assert eight.pool
    assert eight.cpu_scale == 1.0
    assert eight.intra == LinkClass(0.0, POOL.byte_cpu)
    assert eight.msg_cpu == POOL.msg_cpu
    assert eight.exit_gap == 0.0  # the waves come out of the pool
    assert Profile.from_json(eight.to_json()) == eight
    shared = prof.placed(8, "shared")
    assert not shared.pooled
    assert shared.cpu_scale == 4.0
    assert shared.intra == LinkClass(POOL.alpha, POOL.beta)
    # not oversubscribed: the dedicated link, no pool
    assert not prof.placed(2).pooled
    assert prof.placed(2).intra == LINK
    with pytest.raises(ValueError, match="model"):
        prof.placed(8, "fast")


def _computes(prof: Profile, starts: list[float]) -> dict[int, float]:
    """One host, one rank per start time: each computes 1 s (a compute op) from then."""
    P = len(starts)
    w = SimWorld(P, prof)
    done: dict[int, float] = {}
    for r, t0 in enumerate(starts):
        s = Schedule(r, P, slots={"x": SlotSpec(250, "float32")})
        s.compute("sum", ["x", "x"], "x")
        ex = SimExecutor(w, s.commit(), sched_id=1,
                         on_complete=lambda e, r=r: done.setdefault(r, w.now))
        w.at(t0, ex.start)
    w.run()
    return done


def test_a_pool_of_cores_serves_only_ranks_that_have_work() -> None:
    # reduce_bps: 1000 B/s, so each rank's compute op (1000 B out) takes 1 s of a core
    base = Profile("t", LINK, LINK, gamma=0.0, reduce_bps=1000.0, ranks_per_host=2, cores=1,
                   pool=True)
    # two ranks at once on one core: one waits for the other
    assert sorted(_computes(base, [0.0, 0.0]).values()) == pytest.approx([1.0, 2.0])
    # one after the other: nobody waits (the scaled model would charge each 2 s)
    assert _computes(base, [0.0, 1.5]) == pytest.approx({0: 1.0, 1: 2.5})
    assert _computes(base.with_(pool=False), [0.0, 1.5]) == pytest.approx({0: 2.0, 1: 3.5})
    # two cores: both at once
    two = base.with_(cores=2, ranks_per_host=2)
    assert not two.pooled
    assert _computes(two, [0.0, 0.0]) == pytest.approx({0: 1.0, 1: 1.0})


def _one_message(prof: Profile, nbytes: int, data: bool = False) -> dict[int, float]:
    """Rank 0 sends rank 1 one message of ``nbytes`` (float32); when each completed.
    ``data``: the executors hold buffers (the send goes through ``SimWorld.post``, not the
    executor's inlined path)."""
    w = SimWorld(2, prof)
    s0 = Schedule(0, 2, slots={"x": SlotSpec(nbytes // 4, "float32")})
    s0.send(1, "x", tag=1)
    s1 = Schedule(1, 2, slots={"x": SlotSpec(nbytes // 4, "float32")})
    s1.recv(0, "x", tag=1)
    done: dict[int, float] = {}
    exs = [SimExecutor(w, s.commit(), sched_id=1,
                       buffers={"x": np.zeros(nbytes // 4, np.float32)} if data else None,
                       kernels=KERNELS if data else None,
                       on_complete=lambda e, r=r: done.setdefault(r, w.now))
           for r, s in enumerate((s0, s1))]
    for ex in exs:
        ex.start()
    w.run()
    return done


def test_a_pooled_host_s_message_is_its_receiver_s_cpu() -> None:
    g = 1e-3
    prof = Profile("t", LinkClass(0.0, 1e-6), LinkClass(0.0, 1e-6), gamma=g, reduce_bps=1e9,
                   ranks_per_host=2, cores=1, pool=True, msg_cpu=0.1)
    done = _one_message(prof, 4000)
    # the send's gamma, then the receiver's gamma + msg_cpu + 4000 B at 1 us/B, on the one core
    assert done[1] == pytest.approx(g + g + 0.1 + 4000 * 1e-6)
    assert done[0] == pytest.approx(g)  # no wire time: the bytes are the receiver's work


# the 4 MiB allreduce at P = 4 sends 1 MiB messages: a shape whose largest size is below them
# prices them at the per-byte figure itself, one above them at a fraction of it
@pytest.mark.parametrize("shape", [(), ((1 << 16, 0.2e-9), (1 << 20, 0.4e-9)),
                                   ((1 << 19, 0.2e-9), (4 << 20, 0.4e-9))],
                         ids=["none", "below", "above"])
def test_fit_pool_recovers_the_figures_the_periods_came_from(
        shape: tuple[tuple[int, float], ...]) -> None:
    prof = PROF.with_(shared=POOL, byte_shape=shape)
    placed = prof.placed(4)
    bar = _sim_barrier_period(placed)
    big = _sim_allreduce_period(placed, 4 << 20)
    msg, per_byte = fit_pool(prof.with_(shared=None), 4, bar, big, 4 << 20)
    assert msg == pytest.approx(POOL.msg_cpu, rel=1e-3)
    assert per_byte == pytest.approx(POOL.byte_cpu, rel=1e-3)
    if shape:  # a smaller allreduce (256 and 512 KiB messages) costs less with the shape
        small = _sim_allreduce_period(placed, 1 << 20)
        assert small < _sim_allreduce_period(PROF.with_(shared=POOL).placed(4), 1 << 20)


def test_a_pooled_message_takes_the_core_from_its_arrival() -> None:
    # one core: a message that costs its receiver 1 s arrives at 0, a compute op of 1 s is
    # ready at 0.5: the receipt holds the core first (booked from its arrival, not from when
    # an idle receiver would have been done with it)
    prof = Profile("t", LinkClass(0.0, 0.0), LinkClass(0.0, 0.0), gamma=0.0, reduce_bps=1000.0,
                   ranks_per_host=2, cores=1, pool=True, msg_cpu=1.0)
    w = SimWorld(2, prof)
    done: dict[str, float] = {}
    s0 = Schedule(0, 2, slots={"x": SlotSpec(1, "float32")})
    s0.send(1, "x", tag=1)
    s1 = Schedule(1, 2, slots={"x": SlotSpec(1, "float32")})
    s1.recv(0, "x", tag=1)
    c0 = Schedule(0, 2, slots={"x": SlotSpec(250, "float32")})
    c0.compute("sum", ["x", "x"], "x")
    for name, s, sid, t0 in (("send", s0, 1, 0.0), ("recv", s1, 1, 0.0), ("compute", c0, 2, 0.5)):
        ex = SimExecutor(w, s.commit(), sched_id=sid,
                         on_complete=lambda e, n=name: done.setdefault(n, w.now))
        w.at(t0, ex.start)
    w.run()
    assert done == pytest.approx({"send": 0.0, "recv": 1.0, "compute": 2.0})


def test_calibration_ranks_measure_the_transport_not_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the default allreduce takes shared memory on one host from 128 KiB up: a calibration of
    # tcp must keep its ranks off it (bench/allreduce.py's asynccoll-tcp row does the same)
    from asynccoll.collectives.shm import SHM_MIN_BYTES
    from asynccoll.sim.calibrate import _child_env

    monkeypatch.setenv("ASYNCCOLL_SHM", "1")
    monkeypatch.setenv("ASYNCCOLL_SECRET", "restored after the test")  # both are restored
    _child_env()
    assert os.environ["ASYNCCOLL_SHM"] == "0"
    assert SHM_MIN_BYTES < 4 << 20  # why it matters: the calibration's large allreduce


SHAPE = ((1000, 0.5e-6), (4000, 1e-6))


def test_byte_factor_is_the_shape_relative_to_its_largest_size() -> None:
    import json

    prof = PROF.with_(byte_shape=SHAPE)
    assert PROF.byte_factor(123) == 1.0  # no shape: one figure for every size
    assert prof.byte_factor(1000) == pytest.approx(0.5)
    assert prof.byte_factor(2000) == pytest.approx(0.75)  # halfway in log2 of the size
    assert prof.byte_factor(10) == pytest.approx(0.5)  # the nearest size's outside
    assert prof.byte_factor(1 << 30) == pytest.approx(1.0)
    # smaller messages measured dearer per byte than the largest: noise, priced at 1
    assert PROF.with_(byte_shape=((1000, 2e-6), (4000, 1e-6))).byte_factor(1000) == 1.0
    # through JSON text (lists) and back: the same tuples
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    assert PROF.with_(byte_shape=[[1000, 0.5e-6], [4000, 1e-6]]) == prof
    none = {**PROF.to_json(), "byte_shape": None}
    assert Profile.from_json(none).byte_shape == ()
    assert prof.placed(8).byte_shape == SHAPE
    for bad in (((1000, 1e-6), (1000, 2e-6)), ((4000, 1e-6), (1000, 1e-6)), ((0, 1e-6),),
                ((1000, 0.0),), ((1000.5, 1e-6),), ((True, 1e-6),), ((1000, float("inf")),),
                ((1000,),), 5):
        with pytest.raises(ValueError, match="byte_shape"):
            PROF.with_(byte_shape=bad)


@pytest.mark.parametrize("data", [False, True], ids=["inlined", "post"])
@pytest.mark.parametrize("size", [1000, 2000, 4000])
def test_a_pooled_message_s_bytes_cost_by_its_size(size: int, data: bool) -> None:
    prof = Profile("t", LinkClass(0.0, 1e-6), LinkClass(0.0, 1e-6), gamma=0.0,
                   reduce_bps=1e9, ranks_per_host=2, cores=1, pool=True, msg_cpu=0.1,
                   byte_shape=SHAPE)
    factor = {1000: 0.5, 2000: 0.75, 4000: 1.0}[size]
    assert _one_message(prof, size, data)[1] == pytest.approx(0.1 + size * 1e-6 * factor)
    # a dedicated link (as many cores as ranks: no pool) keeps one figure for every size
    own = prof.with_(cores=2, pool=False, msg_cpu=0.0)
    assert _one_message(own, size, data)[1] == pytest.approx(size * 1e-6)


def test_byte_shape_takes_the_pair_s_one_message_sizes() -> None:
    from asynccoll.sim.calibrate import byte_shape

    rbps = 10e9
    t4 = 100e-6
    # seconds per byte by allreduce size; P = 2 sends one message of the whole vector up to
    # 1 MiB, 1 MiB segments in two rounds above it (left out: not one message's cost)
    per = {1 << 16: 0.6e-9, 1 << 19: 0.2e-9, 1 << 20: 0.3e-9, 4 << 20: 0.9e-9}
    times = {4: t4, **{n: t4 + n * b + n / rbps for n, b in per.items()}}
    got = dict(byte_shape(times, rbps))
    assert set(got) == {1 << 16, 1 << 19, 1 << 20}
    for n in got:
        assert got[n] == pytest.approx(per[n])
    # faster than the fixed costs allow (noise): a floor, not a negative cost
    assert dict(byte_shape({4: t4, 1 << 16: t4 / 2}, rbps))[1 << 16] == 1e-12


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_calibration_measures_the_shape_between_two_processes() -> None:
    from asynccoll.sim.calibrate import SHAPE_SIZES, calibrate

    prof = calibrate(("tcp",), calls=5, large=4 << 20, repeats=1, shared=False)["tcp"]
    # every shape size (one message each at P = 2), not the 4 MiB call (segments)
    assert [n for n, _ in prof.byte_shape] == list(SHAPE_SIZES)
    assert set(prof.figures["byte_shape_GBps"]) == {str(n) for n in SHAPE_SIZES}
    assert all(f"allreduce_p2_{n}B_inline_us" in prof.figures for n in SHAPE_SIZES)
    assert str(SHAPE_SIZES[0] >> 10) + " KiB" in prof.source
