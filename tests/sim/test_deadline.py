"""The adaptive deadline: its decision function and its behaviour in the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll import Deadline
from asynccoll.sim import SimPartial, SimWorld, next_deadline, simulate

from ._script import FAST


def test_next_deadline_is_the_runtimes() -> None:
    from asynccoll.collectives import partial

    assert next_deadline is partial.next_deadline


def test_next_deadline_is_median_plus_m_mad_clamped() -> None:
    s = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, MAD 1
    assert next_deadline(s, 2.0, 0.0, 1e9) == pytest.approx(5.0)
    assert next_deadline(s, 2.0, 6.0, 10.0) == 6.0
    assert next_deadline(s, 2.0, 0.0, 4.0) == 4.0
    assert next_deadline([], 2.0, 0.1, 0.7) == 0.7
    with pytest.raises(ValueError, match="m must"):
        next_deadline(s, -1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="lo and hi"):
        next_deadline(s, 1.0, 2.0, 1.0)


def _run(arrive: np.ndarray, policy: Deadline) -> SimPartial:
    """Steps separated by a second; rank r calls at ``arrive[s, r]`` seconds into step s."""
    steps, P = arrive.shape
    w = SimWorld(P, FAST)
    h = SimPartial(w, policy, np.zeros(1, np.float32), data=False)
    for s in range(steps):
        for r in range(P):
            w.at(10.0 * s + arrive[s, r], h.call, r, None, lambda res, r: None)
    w.run()
    return h


@pytest.mark.timeout(30)
def test_never_starts_with_fewer_than_k_before_the_deadline() -> None:
    rng = np.random.default_rng(1)
    P, k = 16, 12
    arrive = rng.exponential(0.02, (40, P))
    h = _run(arrive, Deadline(quorum=k, bounds=(1e-3, 0.5), mad_factor=2.0))
    checked = 0
    for e, (_count, fresh, _flushed) in h.executions.items():
        if e not in h.first_arrival:
            continue
        waited = h.started_at[e] - h.first_arrival[e]
        if fresh < k:
            # fewer than k: only the deadline may have started it
            assert waited >= h.deadlines[e] - 1e-9, (e, fresh, waited, h.deadlines[e])
            checked += 1
        else:
            assert waited <= h.deadlines[e] + 1e-3
    assert checked > 0


@pytest.mark.timeout(30)
def test_starts_at_the_deadline_when_fewer_arrived() -> None:
    P, k = 8, 8
    arrive = np.zeros((1, P))
    arrive[0, 5:] = 5.0  # three ranks are 5 s late; the deadline is 50 ms
    h = _run(arrive, Deadline(quorum=k, bounds=(0.05, 0.05)))
    waited = h.started_at[0] - h.first_arrival[0]
    assert waited == pytest.approx(0.05, abs=1e-3)
    assert h.executions[0][1] == 5  # the five early ranks' data, fresh
    assert 0 in h.forced_by_deadline


@pytest.mark.timeout(30)
def test_adapts_up_when_arrivals_spread_and_down_when_they_tighten() -> None:
    rng = np.random.default_rng(2)
    P, k = 16, 16
    tight = rng.uniform(0, 0.002, (30, P))
    wide = rng.uniform(0, 0.2, (30, P))
    arrive = np.concatenate([tight, wide, tight])
    h = _run(arrive, Deadline(quorum=k, bounds=(1e-3, 1.0), mad_factor=3.0, window=8))
    d = [h.deadlines[e] for e in sorted(h.deadlines)]
    n = len(d)
    first, middle, last = d[n // 6: n // 3], d[n // 2 - 5: n // 2 + 5], d[-5:]
    assert np.median(middle) > 5 * np.median(first), (first, middle)
    assert np.median(last) < np.median(middle) / 5, (middle, last)


@pytest.mark.timeout(60)
def test_accumulate_keeps_replicas_equal() -> None:
    P, steps = 8, 12
    run = simulate(Deadline(quorum=6, bounds=(1e-5, 1e-2)), P, steps, profile=FAST,
                   compute=np.random.default_rng(3).exponential(1e-3, (steps, P)),
                   nbytes=8, data=True, accumulate=True, keep_results=True, flush=True,
                   values=lambda r, s: np.full(2, float(r * 100 + s), np.float32))
    assert run.results is not None
    assert run.flushes is not None
    # every rank's values, summed with its flush, agree: plain SGD replicas stay equal
    totals = {r: sum(res.value for res in run.results[r]) + run.flushes[r].value
              for r in range(P)}
    for r in range(1, P):
        np.testing.assert_array_equal(totals[r], totals[0])
