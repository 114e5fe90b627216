"""The time-shared cores' part of the cost model: placement, exit waves, and the fit that
``asynccoll sim calibrate`` makes of them."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll.sim.calibrate import _sim_allreduce_period, _sim_barrier_period, fit_shared
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
