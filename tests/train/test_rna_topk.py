"""RNA's staleness-weighted accumulation and lr scaling; top-k SGD with QSGD."""

from __future__ import annotations

import numpy as np
import pytest
from _train_problem import P, Problem, one_random_rank, run_ranks

from asynccoll.testing import local_world
from asynccoll.train import RNA, TopKSGD


async def test_rna_weights_waiting_gradients_linearly_and_bounds_staleness() -> None:
    """RNA §3.3: waiting gradients weigh linearly by age; past the bound only the too-old ones
    are dropped, those within it stay."""
    async with local_world(1, progress="inline") as comms:
        opt = RNA(comms[0], np.zeros(3), 0.1, staleness_bound=2)
        acc = np.zeros(3)
        gs = [np.full(3, v) for v in (1.0, 10.0, 100.0, 1000.0)]
        n = 0
        for k, g in enumerate(gs[:3]):  # steps 0, 1, 2 wait in the buffer together
            opt.steps = k
            n = opt._combine()(acc, g, n, False)
        # weights t - (k - tau) + 1 = 1, 2, 3 for steps 0, 1, 2
        np.testing.assert_allclose(acc, (1 * 1 + 2 * 10 + 3 * 100) / 6)
        assert n == 1
        opt.steps = 3  # step 0 is now 3 > staleness_bound old: dropped; steps 1 and 2 stay
        n = opt._combine()(acc, gs[3], n, False)
        np.testing.assert_allclose(acc, (1 * 10 + 2 * 100 + 3 * 1000) / 6)
        opt.steps = 6  # steps 1, 2, 3 are all more than 2 steps old: only the fresh one is left
        n = opt._combine()(acc, gs[1], n, False)
        np.testing.assert_array_equal(acc, gs[1])
        opt.steps = 4  # a snapshot took the buffer (n == 0): start afresh
        opt._combine()(acc, gs[0], 0, False)
        np.testing.assert_array_equal(acc, gs[0])


@pytest.mark.timeout(60)
async def test_rna_scales_lr_by_contributors() -> None:
    prob = Problem(8)
    lr = 0.1
    async with local_world(P, "inproc", timeout=20) as comms:
        out = await run_ranks(comms, lambda c, w: RNA(c, w, lr), prob, 40,
                              delay=one_random_rank(3, 0.01))
    infos = [i for _, _, infos in out for i in infos if not i.synced]
    assert all(i.lr == pytest.approx(lr * len(i.contributors) / P) for i in infos)
    assert any(len(i.contributors) < P for i in infos), "no round without a straggler"
    assert all(i.count == len(i.contributors) for i in infos)  # one weighted mean per rank
    assert prob.excess(out[0][1]) < 0.05


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [4, 8])
async def test_topk_sgd_with_qsgd_converges(bits: int) -> None:
    prob = Problem(9)
    make = lambda c, w: TopKSGD(c, w, 0.1, k=4, quantize=bits, qbucket=4)  # noqa: E731
    async with local_world(P, "inproc", timeout=20) as comms:
        out = await run_ranks(comms, make, prob, 80)
    for _, w, _ in out:
        np.testing.assert_array_equal(w, out[0][1])
    assert prob.excess(out[0][1]) < 0.05


# -- TopKSGD in real processes: its handle through shared memory, the same bits as the network --
async def _topk_rank(rank: int, world: int, port: int, shm: bool) -> tuple[bool, str, str]:
    import hashlib
    import os

    import asynccoll

    os.environ["ASYNCCOLL_SHM"] = "1" if shm else "0"
    comm = await asynccoll.connect(rank=rank, world_size=world, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    async with comm:
        w = np.zeros(60_000, np.float32)
        opt = TopKSGD(comm, w, 0.1, density=0.3, name="topk")
        for step in range(4):
            g = np.random.default_rng([rank, step]).standard_normal(w.size).astype(np.float32)
            await opt.step(g)
        got = (opt._allreduce.shm, opt._allreduce.algorithm,
               hashlib.sha1(opt.params.tobytes()).hexdigest())
        await opt.finish()
        await comm.barrier(timeout=30)
    return got


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_topk_sgd_on_one_host_goes_through_shared_memory_with_the_same_bits() -> None:
    from _helpers import async_child, free_port, spawn_world

    runs = {shm: spawn_world(async_child, 3, (_topk_rank, free_port(), shm), 120)
            for shm in (True, False)}
    for shm, got in runs.items():
        assert all(g[0] is shm for g in got), got
        assert all(g[1].endswith("split_allgather") for g in got), got
        assert len({g[2] for g in got}) == 1, got  # every rank's parameters, bit for bit
    assert runs[True][0][2] == runs[False][0][2]  # and the same bits as over the network
