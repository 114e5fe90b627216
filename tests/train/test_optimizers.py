"""Every optimizer of asynccoll.train against synchronous SGD on a convex problem.

"No stragglers" runs use an inline progress engine and an asyncio barrier per step: every rank
hands in its gradient before any message is processed, so every round holds every rank's
gradient and the partial methods must reproduce synchronous SGD. Straggler runs use the progress
thread and sleep one seeded random rank per step.
"""

from __future__ import annotations

import numpy as np
import pytest
from _train_problem import P, Problem, one_random_rank, run_ranks

from asynccoll import Majority, Quorum, Solo, Sync, TwoChoice
from asynccoll.testing import local_world
from asynccoll.train import ODSGD, RNA, BackupSGD, EagerSGD, TopKSGD

TRANSPORTS = ["inproc", "tcp"]
LR = 0.2
STEPS = 30

MAKERS = {
    "sync": lambda c, w: EagerSGD(c, w, LR, policy=Sync()),
    "solo": lambda c, w: EagerSGD(c, w, LR, policy=Solo()),
    "majority": lambda c, w: EagerSGD(c, w, LR, policy=Majority(seed=3)),
    "two_choice": lambda c, w: EagerSGD(c, w, LR, policy=TwoChoice(), accumulate=True),
    "quorum": lambda c, w: EagerSGD(c, w, LR, policy=Quorum(2), average="contributions"),
    "rna": lambda c, w: RNA(c, w, LR),
    "backup0": lambda c, w: BackupSGD(c, w, LR, backups=0),
    "backup1": lambda c, w: BackupSGD(c, w, LR, backups=1, average="contributions"),
    "odsgd_w": lambda c, w: ODSGD(c, w, LR, warmup=STEPS + 1),
    "topk_n": lambda c, w: TopKSGD(c, w, LR, k=w.size),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("method", list(MAKERS))
async def test_no_stragglers_equals_synchronous_sgd(transport: str, method: str) -> None:
    prob = Problem(1)
    ref = prob.sync_sgd(LR, STEPS)
    async with local_world(P, transport, progress="inline", timeout=20) as comms:
        out = await run_ranks(comms, MAKERS[method], prob, STEPS, aligned=True)
    for opt, w, infos in out:
        np.testing.assert_allclose(w, ref, rtol=1e-10, atol=1e-12)
        assert all(i.included and i.count == P and i.staleness == 0 for i in infos), \
            [(i.included, i.count, i.staleness) for i in infos]
        assert [i.lr for i in infos] == [LR] * STEPS
        if isinstance(opt, EagerSGD):
            assert [i.round for i in infos] == list(range(STEPS))


CONVERGE = {
    "solo": lambda c, w: EagerSGD(c, w, 0.1, policy=Solo()),
    "majority": lambda c, w: EagerSGD(c, w, 0.1, policy=Majority(), sync_every=10),
    "solo_acc_bound": lambda c, w: EagerSGD(c, w, 0.1, policy=Solo(), accumulate=True,
                                            max_staleness=3, momentum=0.5),
    "rna": lambda c, w: RNA(c, w, 0.1, staleness_bound=2),
    "backup": lambda c, w: BackupSGD(c, w, 0.1, backups=1),
    "odsgd_sgd": lambda c, w: ODSGD(c, w, 0.1, warmup=3),
    "odsgd_dc_a": lambda c, w: ODSGD(c, w, 0.1, warmup=3, local="dc-asgd-a"),
    "topk": lambda c, w: TopKSGD(c, w, 0.1, k=3),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("method", list(CONVERGE))
async def test_converges_under_injected_delays(transport: str, method: str) -> None:
    prob = Problem(2)
    steps = 60
    async with local_world(P, transport, timeout=20) as comms:
        out = await run_ranks(comms, CONVERGE[method], prob, steps,
                              delay=one_random_rank(7, 0.004))
    for _opt, w, _infos in out:
        assert prob.excess(w) < 0.05, (method, prob.excess(w))
    # finish() leaves every replica equal (parameter average or global weights).
    for _, w, _ in out[1:]:
        np.testing.assert_array_equal(w, out[0][1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_eager_accumulate_keeps_replicas_equal_and_counts_every_gradient(
        transport: str) -> None:
    prob = Problem(3)
    steps = 40
    make = lambda c, w: EagerSGD(c, w, 0.05, policy=Solo(), accumulate=True)  # noqa: E731
    async with local_world(P, transport, timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps, delay=one_random_rank(5, 0.01),
                              finish=lambda o: o.finish(average=False))
    ws = [w for _, w, _ in out]
    assert any(not i.included for _, _, infos in out for i in infos), "no straggler effect"
    for w in ws[1:]:  # equal without any parameter averaging
        np.testing.assert_allclose(w, ws[0], rtol=1e-12, atol=1e-14)
    for opt, _, infos in out:
        # never dropped, never counted twice: every rank applied all P * steps gradients
        assert opt.applied == P * steps
        # staleness accounting follows the collective's report
        run = 0
        for i in infos:
            run = 0 if i.included else run + 1
            assert i.staleness == run
            if i.synced:  # a sync event drains the send buffer
                run = 0
            assert i.count == 0 or i.contributors
            assert i.count >= len(i.contributors)
    assert prob.excess(ws[0]) < 0.1


ACCUMULATING = {
    "eager-solo-world": lambda c, w: EagerSGD(c, w, 0.05, policy=Solo(), accumulate=True),
    "eager-solo-contributions": lambda c, w: EagerSGD(c, w, 0.05, policy=Solo(), accumulate=True,
                                                      average="contributions"),
    "eager-majority-contributions": lambda c, w: EagerSGD(c, w, 0.05, policy=Majority(),
                                                          accumulate=True, average="contributions"),
    "backup-quorum": lambda c, w: BackupSGD(c, w, 0.05, backups=1),
    "backup-contributions": lambda c, w: BackupSGD(c, w, 0.05, backups=1, average="contributions"),
    "rna": lambda c, w: RNA(c, w, 0.05, accumulate=True),
}


@pytest.mark.alone  # a straggler must fall behind: timing
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("method", sorted(ACCUMULATING))
async def test_every_averaging_mode_with_accumulate_keeps_replicas_equal(
        transport: str, method: str) -> None:
    """Rank 3 is a persistent straggler, so it receives several rounds at once. Averaging by
    contributions must average each round by its own count, or rank 3's steps are smaller and
    the replicas drift (without any parameter averaging to hide it)."""
    prob = Problem(5)

    def delay(r: int, s: int) -> float:
        return 0.03 if r == P - 1 else 0.002

    async with local_world(P, transport, timeout=20) as comms:
        out = await run_ranks(comms, ACCUMULATING[method], prob, 16, delay=delay,
                              finish=lambda o: o.finish(average=False))
    infos = out[P - 1][2]
    assert any(i.missed > 1 for i in infos if not i.synced), "the straggler never fell behind"
    for _, w, _ in out[1:]:
        np.testing.assert_allclose(w, out[0][1], rtol=1e-10, atol=1e-12)
    assert np.abs(out[0][1] - prob.w0).max() > 0  # it trained


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_backup_sgd_aggregates_exactly_p_minus_b(transport: str) -> None:
    prob = Problem(4)
    steps, b = 12, 1

    def delay(r: int, s: int) -> float:
        return 0.05 if r == P - 1 else 0.005  # rank P-1 is a persistent straggler

    make = lambda c, w: BackupSGD(c, w, 0.1, backups=b)  # noqa: E731
    async with local_world(P, transport, timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps, delay=delay)
    for r, (_opt, _w, infos) in enumerate(out):
        # Steps that joined a sync event (the others' finish) are flushes, not quorum rounds.
        plain = [i for i in infos if not i.synced]
        assert plain or r == P - 1
        for i in plain:
            # a late step folds in every round it missed (accumulate=True), each of P - b
            assert i.count == (P - b) * max(i.missed, 1), (r, i)
            assert P - 1 not in i.contributors  # the straggler's late gradients are dropped
        if r == P - 1:
            assert not any(i.included for i in plain)
            assert all(i.staleness >= 1 for i in plain)
        else:
            assert all(i.included for i in plain)
            assert len(plain) >= steps // 2
    for _, w, _ in out[1:]:
        np.testing.assert_array_equal(w, out[0][1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("local", ["sgd", "dc-asgd-c", "dc-asgd-a"])
async def test_odsgd_local_lr_zero_is_sync_sgd_one_step_late(transport: str,
                                                            local: str) -> None:
    prob = Problem(5)
    steps, warm, lr = 20, 4, 0.2
    # Reference: warm-up steps of synchronous SGD, then W_{s+1} = W_s - lr*mean grad(W_{s-1}).
    W = prob.w0.copy()
    for _ in range(warm):
        W -= lr * prob.mean_grad(W)
    at = W.copy()  # the weights the next gradient is computed at
    for _ in range(steps - warm):
        g = prob.mean_grad(at)
        at = W.copy()
        W = W - lr * g
    make = lambda c, w: ODSGD(c, w, lr, warmup=warm, local=local, local_lr=0.0)  # noqa: E731
    async with local_world(P, transport, timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps)
    for _opt, w, infos in out:
        np.testing.assert_allclose(w, W, rtol=1e-10, atol=1e-12)
        assert [i.staleness for i in infos] == [0] * warm + [1] * (steps - warm)
        assert [i.round for i in infos] == list(range(warm)) + list(range(warm - 1,
                                                                          steps - 1))


async def test_bad_arguments_name_the_argument() -> None:
    async with local_world(2, progress="inline") as comms:
        w = np.zeros(4)
        with pytest.raises(ValueError, match="policy"):  # (the argument was mode=)
            EagerSGD(comms[0], w, 0.1, policy="fast")
        with pytest.raises(ValueError, match="sync_every"):
            EagerSGD(comms[0], w, 0.1, sync_every=0)
        with pytest.raises(ValueError, match="backups"):
            BackupSGD(comms[0], w, 0.1, backups=2)
        with pytest.raises(ValueError, match="warmup"):
            ODSGD(comms[0], w, 0.1, warmup=-1)
        with pytest.raises(ValueError, match="staleness_bound"):
            RNA(comms[0], w, 0.1, staleness_bound=-1)
        with pytest.raises(TypeError, match="comm"):
            EagerSGD(object(), w, 0.1)  # type: ignore[arg-type]
