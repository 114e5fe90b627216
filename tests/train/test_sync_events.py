"""Model synchronisation and the staleness bound are collective-safe; torch parameters work."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
from _train_problem import P, Problem, one_random_rank, run_ranks

from asynccoll import Sync
from asynccoll.testing import local_world
from asynccoll.train import EagerSGD


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "kw"), [
    ("solo", {"sync_every": 5}),
    ("majority", {"sync_every": 7, "accumulate": True}),
    ("solo", {"max_staleness": 1}),
])
async def test_every_rank_takes_part_in_the_same_sync_events(mode: str, kw: dict) -> None:
    prob = Problem(6)
    steps = 30
    make = lambda c, w: EagerSGD(c, w, 0.1, mode, **kw)  # noqa: E731
    async with local_world(P, "inproc", timeout=20) as comms:
        out = await run_ranks(comms, make, prob, steps, delay=one_random_rank(11, 0.006))
    syncs = [opt.syncs for opt, _, _ in out]
    assert len(set(syncs)) == 1, syncs  # the same sequence of events everywhere
    triggered = sum(i.synced for _, _, infos in out for i in infos)
    assert triggered >= P, "sync events were triggered during training"
    if "sync_every" in kw:
        assert syncs[0] >= steps // kw["sync_every"]
    for _, w, _ in out[1:]:
        np.testing.assert_array_equal(w, out[0][1])
    assert prob.excess(out[0][1]) < 0.1


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.timeout(60)
async def test_torch_parameters_train_in_place() -> None:
    import torch

    async with local_world(2, "inproc", progress="inline", timeout=20) as comms:
        nets = []
        for _ in range(2):
            torch.manual_seed(0)
            nets.append(torch.nn.Linear(3, 2))
        opts = [EagerSGD(c, list(n.parameters()), 0.5, policy=Sync()) for c, n in
                zip(comms, nets, strict=True)]
        before = nets[0].weight.detach().clone()
        x = torch.ones(4, 3)
        for r, n in enumerate(nets):
            n.zero_grad()
            (n(x * (r + 1)).sum()).backward()
        grads = [[p.grad for p in n.parameters()] for n in nets]
        infos = await asyncio.gather(*(o.step(g) for o, g in zip(opts, grads, strict=True)))
        assert all(i.count == 2 for i in infos)
        # d(sum(Wx+b))/dW = x summed over the batch: rank r has 4*(r+1); the mean is 6.
        torch.testing.assert_close(nets[0].weight.detach(), before - 0.5 * 6.0)
        torch.testing.assert_close(nets[1].weight.detach(), nets[0].weight.detach())
        assert np.shares_memory(opts[0].params, nets[0].weight.detach().numpy())
