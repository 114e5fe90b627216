"""The DDP communication hook with ``Deadline(...)``, driven with stand-in buckets (the
hook only calls ``index()``, ``buffer()`` and ``parameters()``) on an in-process world."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from asynccoll import Deadline, Majority
from asynccoll.testing import local_world
from asynccoll.torch import partial_hook


class Bucket:
    def __init__(self, buf: torch.Tensor, params: list[torch.Tensor]) -> None:
        self._buf, self._params = buf, params

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def grad(rank: int, step: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) + 10.0 * rank + 100.0 * step


@pytest.mark.timeout(60)
async def test_deadline_hook_cuts_a_straggler_and_conserves_gradients() -> None:
    P, steps = 3, 6
    async with local_world(P, timeout=20) as comms:
        made = [partial_hook(c, Deadline(bounds=(0.02, 0.05), window=4), average="world",
                             name="dl") for c in comms]
        states = [s for s, _ in made]
        params = [[torch.zeros(6, dtype=torch.float64)] for _ in range(P)]
        applied = [torch.zeros(6, dtype=torch.float64) for _ in range(P)]
        for s in range(steps):
            futs: list[Any] = []
            for r in range(P):
                if r == P - 1 and s >= 2:
                    await asyncio.sleep(0.25)  # a straggler: the deadline cuts it off
                futs.append(states[r].reduce(Bucket(grad(r, s), params[r])))
            for r, f in enumerate(futs):
                applied[r] += await asyncio.to_thread(f.wait)
        # finish(None): the in-flight gradients into .grad, for the check below to apply
        held = await asyncio.gather(*(asyncio.to_thread(st.finish, None) for st in states))
        assert len(set(held)) == 1
        for r in range(P):
            g = params[r][0].grad
            assert g is not None
            applied[r] += g
        ref = torch.stack([grad(r, s) for r in range(P) for s in range(steps)]).sum(0) / P
        for r in range(P):
            np.testing.assert_allclose(applied[r].numpy(), ref.numpy(), rtol=1e-12)
        steps_seen = [st.buckets[0] for st in states]
        assert all(b.deadline is not None and 0.02 <= b.deadline <= 0.05 for b in steps_seen)
        assert steps_seen[0].deadline_expired is True
        assert steps_seen[0].contributors == frozenset(range(P))  # the stale gradient rides


@pytest.mark.timeout(30)
async def test_bad_arguments_name_the_argument() -> None:
    async with local_world(2) as comms:
        with pytest.raises(ValueError, match="deadline"):
            partial_hook(comms[0], Deadline(bounds=(1.0, 0.5)))
        with pytest.raises(ValueError, match="mad_factor"):
            partial_hook(comms[0], Deadline(mad_factor=-2.0))
        with pytest.raises(ValueError, match="quorum"):
            partial_hook(comms[0], Deadline(quorum=3))
        with pytest.raises(TypeError, match="deadline"):  # (a keyword that is gone)
            partial_hook(comms[0], Majority(), deadline=0.1)
