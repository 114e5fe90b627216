"""``EagerSGD(policy=Deadline(...))``: k arrivals or an adaptive deadline start each round."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _train_problem import P, Problem, one_random_rank, run_ranks

from asynccoll import Deadline, Solo
from asynccoll.testing import local_world
from asynccoll.train import EagerSGD


@pytest.mark.timeout(60)
async def test_no_stragglers_equals_synchronous_sgd() -> None:
    prob = Problem(1)
    steps = 12
    ref = prob.sync_sgd(0.2, steps)
    make = lambda c, w: EagerSGD(c, w, 0.2, policy=Deadline(bounds=2.0))  # noqa: E731
    async with local_world(P, progress="inline", timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps, aligned=True)
    for _opt, w, infos in out:
        np.testing.assert_allclose(w, ref, rtol=1e-10, atol=1e-12)
        assert [i.round for i in infos] == list(range(steps))
        assert all(i.included and i.count == P for i in infos)
        assert all(i.deadline == 2.0 and i.deadline_expired is False for i in infos)


@pytest.mark.timeout(90)
async def test_stragglers_cut_off_and_accumulate_keeps_replicas_equal() -> None:
    prob = Problem(3)
    steps = 24

    def make(c: Any, w: np.ndarray) -> EagerSGD:
        return EagerSGD(c, w, 0.05,
                        policy=Deadline(quorum=P, bounds=(0.005, 0.03), mad_factor=2.0, window=6),
                        accumulate=True)

    async with local_world(P, timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps, delay=one_random_rank(5, 0.08),
                              finish=lambda o: o.finish(average=False))
    ws = [w for _, w, _ in out]
    for w in ws[1:]:  # equal without any parameter averaging
        np.testing.assert_allclose(w, ws[0], rtol=1e-12, atol=1e-14)
    infos = [i for _, _, rank_infos in out for i in rank_infos]
    assert any(i.deadline_expired for i in infos), "no round was cut by the deadline"
    assert all(i.deadline is not None and 0.005 <= i.deadline <= 0.03 for i in infos)
    for opt, _, _ in out:
        assert opt.applied == P * steps  # never dropped, never counted twice
    assert prob.excess(ws[0]) < 0.2


@pytest.mark.timeout(30)
async def test_bad_arguments_name_the_argument() -> None:
    async with local_world(2, progress="inline") as comms:
        w = np.zeros(3)
        with pytest.raises(TypeError, match="deadline"):  # (no Solo with a deadline now)
            EagerSGD(comms[0], w, 0.1, Solo(), deadline=0.1)
        with pytest.raises(ValueError, match="mad_factor"):
            EagerSGD(comms[0], w, 0.1, policy=Deadline(mad_factor=-1.0))
        with pytest.raises(ValueError, match="deadline"):
            EagerSGD(comms[0], w, 0.1, policy=Deadline(bounds=(0.2, 0.1)))
        with pytest.raises(ValueError, match="quorum"):
            EagerSGD(comms[0], w, 0.1, policy=Deadline(quorum=3))
