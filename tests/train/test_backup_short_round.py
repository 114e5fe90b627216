"""Backup workers averaging by contributions: a round short of the quorum (only a flush makes
one) is averaged by the quorum, not by its own count (asynccoll.train.backup, "Averaging").

The scenario: P = 4, Backup(1) (a quorum of 3). Rank 3 takes one step more than the others
(they take none) and the others call ``finish()``: their flush completes rank 3's round with
its gradient alone. Before the rule, every rank applied that one gradient as a full step
(``lr * g``: one reading after ``finish()`` fell 8 points on the digits, docs/torch.md); now
a third of it (``lr * g / 3``), as if the two missing gradients of the quorum were zeros.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from asynccoll import Backup
from asynccoll.testing import local_world
from asynccoll.train import BackupSGD
from asynccoll.train.backup import short_round_scale

P, LR = 4, 0.5
G = np.arange(1.0, 9.0)  # rank 3's gradient


def test_the_scale() -> None:
    assert short_round_scale(1, 3) == pytest.approx(1 / 3)
    assert short_round_scale(2, 3) == pytest.approx(2 / 3)
    assert short_round_scale(3, 3) == 1.0
    assert short_round_scale(4, 3) == 1.0  # a near tie: more than the quorum, its own count
    assert short_round_scale(0, 3) == 1.0  # nothing to scale


@pytest.mark.timeout(30)
async def test_backup_sgd_by_contributions_averages_a_short_round_by_the_quorum() -> None:
    async with local_world(P, "inproc", progress="inline", timeout=10) as comms:
        opts = [BackupSGD(c, np.zeros(G.size), LR, backups=1, average="contributions")
                for c in comms]
        step3 = asyncio.ensure_future(opts[3].step(G))
        await asyncio.sleep(0.2)  # (one loop for every rank: its gradient is in by now)
        assert not step3.done()  # the quorum of 3 is not there: it waits

        async def rank3() -> Any:
            info = await step3
            await opts[3].finish()
            return info

        *_, info = await asyncio.gather(*(o.finish() for o in opts[:3]), rank3())
    assert info.count == 1  # its round held its gradient alone
    for o in opts:
        np.testing.assert_allclose(o.params, -LR * G / 3, rtol=1e-12)


@pytest.mark.timeout(60)
async def test_the_torch_optimizer_averages_a_short_round_by_the_quorum() -> None:
    torch = pytest.importorskip("torch")
    from asynccoll.torch import DistributedOptimizer

    async with local_world(P, "inproc", timeout=20) as comms:
        ws = [torch.zeros(G.size, dtype=torch.float64, requires_grad=True) for _ in range(P)]
        opts = [DistributedOptimizer(torch.optim.SGD([w], lr=LR), c, Backup(1), broadcast=False,
                                     name="short-round")
                for w, c in zip(ws, comms, strict=True)]
        assert opts[0].average == "contributions"  # Backup's default
        stepped = threading.Event()
        infos: list[Any] = []

        def rank3() -> None:
            ws[3].grad = torch.from_numpy(G.copy())
            stepped.set()
            infos.append(opts[3].step())  # waits for the others' flush
            opts[3].finish()

        loop = asyncio.get_running_loop()
        t3 = loop.run_in_executor(None, rank3)
        await loop.run_in_executor(None, stepped.wait, 10)
        await asyncio.sleep(0.5)  # its call is on the progress thread, its gradient deposited
        await asyncio.gather(t3, *(loop.run_in_executor(None, o.finish) for o in opts[:3]))
    assert infos[0].count == 1
    for w in ws:
        np.testing.assert_allclose(w.detach().numpy(), -LR * G / 3, rtol=1e-12)
