"""One rank of tests/torch/test_conventions.py, started by ``asynccoll run`` or torchrun.

An unchanged torch.distributed setup (``init_process_group("gloo")`` from the environment),
then asynccoll beside it: two DDP hooks on one communicator, ``finish`` without and with the
optimizer, DistributedOptimizer over a DDP model (refused) and with ``Quorum(P)``. Prints
``CONVENTIONS OK <rank>`` when every check held.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll
from asynccoll.torch import DistributedOptimizer, partial_hook


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def train(ddp: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()


def same_bytes(comm: asynccoll.BlockingCollectives, params: list[torch.Tensor]) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    everyone = comm.allgather(flat.view(np.uint8))
    return all(bytes(row) == bytes(everyone[0]) for row in everyone)


def expect(kind: type[Exception], words: str, call: Callable[[], object]) -> None:
    """``call()`` raises ``kind`` with ``words`` in its message."""
    try:
        call()
    except kind as exc:
        if words not in str(exc):
            raise AssertionError(f"{kind.__name__} without {words!r}: {exc}") from exc
        return
    raise AssertionError(f"no {kind.__name__} (expected one saying {words!r})")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # as a plain DDP script does: env:// from the launcher
    rank = dist.get_rank()
    with asynccoll.init() as comm:
        assert (comm.rank, comm.size) == (rank, dist.get_world_size())
        states = []
        for k in range(2):  # a second model on the same communicator: no name collision
            ddp = DDP(model(k))
            state, hook = partial_hook(comm, "solo")
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            train(ddp, opt, rank, 4)
            expect(TypeError, "state.finish(opt)", state.finish)
            state.finish(opt)
            assert same_bytes(comm, list(ddp.parameters())), "replicas differ after finish"
            states.append(state)
        assert [s.name for s in states] == ["ddp", "ddp-1"], [s.name for s in states]
        expect(ValueError, "drop DDP", lambda: DistributedOptimizer(
            torch.optim.SGD(ddp.parameters(), lr=0.1), comm))
        plain = model(5)
        dopt = DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), comm,
                                    asynccoll.Quorum(comm.size))
        train(plain, dopt, rank, 3)
        dopt.finish()
        assert same_bytes(comm, list(plain.parameters()))
        print(f"CONVENTIONS OK {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
