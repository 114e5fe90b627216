"""The DDP hook's sync events in a surviving job (asynccoll/torch/hook_events.py), without DDP:
three ranks of one process over loopback tcp, each a thread that hands its gradient to the
hook state as DDP would (a bucket object with ``index``, ``buffer`` and ``parameters``) and
steps its own optimizer. All ranks' optimizers step in one process, so torch's global step
hook fires for each: every state must keep to its own. The real-process join is in
tests/adversarial/test_rejoin.py (``test_the_ddp_hook_takes_restarted_ranks_back_under_churn``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from asynccoll import Majority  # noqa: E402
from asynccoll.testing import local_world  # noqa: E402
from asynccoll.torch import partial_hook  # noqa: E402

P = 3


class Bucket:
    """What the hook reads of DDP's ``GradBucket``: one bucket of every parameter's gradient."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.buf = torch.cat([p.grad.reshape(-1) for p in params])

    def index(self) -> int:
        return 0

    def buffer(self) -> Any:
        return self.buf

    def parameters(self) -> list[Any]:
        return self.params


def train(comm: Any, steps: int, out: dict[int, Any]) -> None:
    """One rank: ``steps`` steps of SGD on a fixed gradient ``rank + 1``, then finish."""
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    state, _ = partial_hook(comm, Majority(), name="events")
    while state.step_count < steps:
        for p in params:
            p.grad = torch.full_like(p, comm.rank + 1.0)
        b = Bucket(params)
        avg = state.reduce(b).wait()
        at = 0
        for p in params:
            p.grad = avg[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        opt.step()
    with pytest.raises(TypeError, match="needs the optimizer"):
        state.finish(None)  # its events step the optimizer: refused, nothing run
    out[comm.rank] = (state.finish(opt), state.syncs, state.step_count,
                      torch.cat([p.detach().reshape(-1) for p in params]),
                      [opt.state[p]["momentum_buffer"].clone() for p in params])


@pytest.mark.timeout(120)
async def test_a_rank_that_finishes_first_holds_events_the_others_join() -> None:
    async with local_world(P, "tcp", timeout=60) as comms:
        for c in comms:
            c.survive = True  # as under asynccoll run --max-failures: the hook has events
        out: dict[int, Any] = {}
        # rank 0 stops after 4 steps, the others go on to 12: its finish() holds sync events
        # until every rank has called finish, and the others join each after a step
        threads = [threading.Thread(target=train, args=(c, 4 if c.rank == 0 else 12, out))
                   for c in comms]
        for t in threads:
            t.start()
        await asyncio.gather(*(asyncio.to_thread(t.join, 100) for t in threads))
    assert sorted(out) == list(range(P)), out
    _, syncs, counts, params, moms = zip(*(out[r] for r in range(P)), strict=True)
    assert counts == (4, 12, 12)
    assert len(set(syncs)) == 1, syncs  # every rank entered the same events
    assert syncs[0] >= 2, syncs  # rank 0's finish ran some while the others stepped
    for r in range(1, P):
        assert torch.equal(params[r], params[0]), (r, params)  # equal to the bit
        for a, b in zip(moms[r], moms[0], strict=True):
            assert torch.equal(a, b), r  # the optimizer's state too (the lowest member's)
    assert all(torch.isfinite(p).all() for p in params)
