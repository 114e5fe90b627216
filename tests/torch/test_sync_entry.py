"""``asynccoll.init()`` (a world of one here; real worlds in test_torch_multiprocess.py) and
the argument checks of asynccoll.torch's entry points."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import asynccoll  # noqa: E402
from asynccoll import Backup, Quorum, Solo  # noqa: E402
from asynccoll.torch import DistributedOptimizer, broadcast_parameters, partial_hook  # noqa: E402


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCOLL_SECRET", "sync-entry-test-secret-0123456789")


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("secret")
def test_init_returns_a_blocking_communicator() -> None:
    with asynccoll.init(rank=0, world_size=1) as comm:
        assert (comm.rank, comm.size) == (0, 1)
        assert comm.comm.progress == "thread"
        assert np.array_equal(comm.allreduce(np.ones(3), op="avg"), np.ones(3))
        t = comm.broadcast(torch.arange(4.0))
        assert isinstance(t, torch.Tensor)
        h = comm.partial_allreduce(Solo(), like=torch.zeros(2), op="avg", name="h")
        r = h(torch.ones(2))
        assert torch.equal(r.value, torch.ones(2))
        assert h.flush().count == 0
        assert comm.submit(comm.comm.allreduce(np.ones(2))).result(10)[0] == 1.0
    with pytest.raises(asynccoll.TransportClosedError):
        comm.allreduce(np.ones(1))


@pytest.mark.timeout(30)
def test_init_refuses_a_running_loop() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match=r"await asynccoll\.connect"):
            asynccoll.init(rank=0, world_size=1)

    asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("secret")
def test_torch_entry_points_check_their_arguments() -> None:
    with asynccoll.init(rank=0, world_size=1) as comm:
        with pytest.raises(ValueError, match="kind must be one of"):  # (a bad policy text)
            partial_hook(comm, "fastest")
        with pytest.raises(ValueError, match="average must be"):
            partial_hook(comm, "solo", average="mean")
        with pytest.raises(ValueError, match="quorum"):
            partial_hook(comm, Quorum(5))
        with pytest.raises(TypeError, match="comm must be a Communicator"):
            partial_hook(object(), "solo")
        p = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match="kind must be one of"):
            DistributedOptimizer(torch.optim.SGD([p], lr=0.1), comm, "fast")
        with pytest.raises(ValueError, match="backup workers must be"):
            DistributedOptimizer(torch.optim.SGD([p], lr=0.1), comm, Backup(1))
        # a world of one: every policy and algorithm is a plain step
        for policy, algorithm in (("sync", None), ("solo", None), (None, "odsgd")):
            q = torch.nn.Parameter(torch.ones(3))
            mode = algorithm or policy
            opt = DistributedOptimizer(torch.optim.SGD([q], lr=0.5), comm, policy,
                                       algorithm=algorithm, name=f"one-{mode}")
            q.grad = torch.ones(3)
            info = opt.step()
            assert info.contributors == frozenset({0})
            assert opt.finish() >= 0
            assert torch.equal(q.detach(), torch.full((3,), 0.5)), (mode, q)
        sd = {"w": torch.ones(2)}
        broadcast_parameters(sd, comm=comm)
        assert torch.equal(sd["w"], torch.ones(2))
