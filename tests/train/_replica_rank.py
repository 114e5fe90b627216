"""One rank of tests/train/test_replica_bytes.py, under ``asynccoll run -n P``.

Trains a least-squares problem with every class and mode that documents equal replicas, with
small random delays so that ranks group rounds differently, in float32 and float64, and checks
after ``finish()`` that every rank holds the same bytes (an allgather of the raw bytes). Prints
``REPLICAS OK <rank> <checks>``, or ``REPLICAS DIFFER <what>`` for each case that did not hold.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import asynccoll
from asynccoll import Majority, Quorum, Solo
from asynccoll.train import ODSGD, RNA, BackupSGD, EagerSGD, TopKSGD

N, STEPS = 517, 12


def grad(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    X = rng.normal(size=(8, w.size)).astype(w.dtype)
    return (X.T @ (X @ (w - 1)) / 8).astype(w.dtype)


def jitter(rng: np.random.Generator) -> None:
    time.sleep(float(rng.uniform(0, 0.004)))


async def same(comm: Any, w: np.ndarray) -> bool:
    everyone = await comm.allgather(np.ascontiguousarray(w).view(np.uint8))
    return all(bytes(row) == bytes(everyone[0]) for row in everyone)


def trainers(comm: Any, dtype: Any) -> list[tuple[str, Callable[[str], Any]]]:
    """(label, a maker of a fresh optimizer over fresh zeros, named by its argument)."""
    def w() -> np.ndarray:
        return np.zeros(N, dtype)

    q = comm.size - 1
    return [
        ("EagerSGD solo", lambda t: EagerSGD(comm, w(), policy=Solo(), lr=0.02, accumulate=True,
                                             name=t)),
        ("EagerSGD majority", lambda t: EagerSGD(comm, w(), policy=Majority(), lr=0.02,
                                                 accumulate=True, name=t)),
        ("EagerSGD contributions", lambda t: EagerSGD(comm, w(), policy=Quorum(q), lr=0.02,
                                                      accumulate=True, average="contributions",
                                                      name=t)),
        ("RNA", lambda t: RNA(comm, w(), lr=0.02, accumulate=True, name=t)),
        ("BackupSGD", lambda t: BackupSGD(comm, w(), lr=0.02, name=t)),
        ("ODSGD", lambda t: ODSGD(comm, w(), lr=0.02, warmup=2)),
        ("TopKSGD", lambda t: TopKSGD(comm, w(), lr=0.02, density=0.1, name=t)),
    ]


async def numpy_part(bad: list[str]) -> int:
    checks = 0
    async with await asynccoll.connect() as comm:
        for dtype in (np.float32, np.float64):
            for label, make in trainers(comm, dtype):
                for average in ((True, False) if label.startswith(("EagerSGD", "RNA")) else
                                (None,)):
                    checks += 1
                    opt = make(f"replicas-{checks}")
                    rng = np.random.default_rng(comm.rank)
                    for _ in range(STEPS):
                        jitter(rng)
                        await opt.step(grad(opt.params, rng))
                    if average is None:
                        await opt.finish()
                    else:
                        await opt.finish(average=average)
                    if not await same(comm, opt.params):
                        bad.append(f"{label} {np.dtype(dtype).name} average={average}")
    return checks


def loop(model: Any, opt: Any, rank: int, dtype: Any) -> None:
    """STEPS steps of a plain torch loop, each after a small random delay."""
    import torch

    rng = np.random.default_rng(rank)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        jitter(rng)
        opt.zero_grad()
        model(torch.randn(4, 13, generator=gen, dtype=dtype)).square().mean().backward()
        opt.step()


def torch_part(bad: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asynccoll.torch import DistributedOptimizer, partial_hook

    torch.set_num_threads(1)
    checks = 0
    with asynccoll.init() as comm:

        def equal(params: list[torch.Tensor]) -> bool:
            flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
            everyone = comm.allgather(flat.view(np.uint8))
            return all(bytes(row) == bytes(everyone[0]) for row in everyone)

        for dtype in (torch.float32, torch.float64):
            modes: tuple[tuple[Any, str | None], ...] = (
                ("sync", None), ("solo", None), ("majority", None), ("two_choice", None),
                (f"quorum:{comm.size}", None), ("deadline", None), ("backup:1", None),
                (None, "rna"), (None, "odsgd"))
            for policy, algorithm in modes:
                mode = algorithm or policy
                torch.manual_seed(comm.rank)  # replicas start apart: the wrapper broadcasts
                model = torch.nn.Linear(13, 3).to(dtype)
                opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm,
                                           policy, algorithm=algorithm,
                                           name=f"opt-{mode}-{dtype}")
                loop(model, opt, comm.rank, dtype)
                opt.finish()
                checks += 1
                if not equal(list(model.parameters())):
                    bad.append(f"DistributedOptimizer {mode} {dtype}")
        dist.init_process_group("gloo")
        for dtype in (torch.float32, torch.float64):
            for kind in ("majority", "solo"):
                torch.manual_seed(0)
                ddp = DDP(torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(),
                                              torch.nn.Linear(7, 3)).to(dtype))
                state, hook = partial_hook(comm, kind)
                ddp.register_comm_hook(state, hook)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
                loop(ddp, opt, comm.rank, dtype)
                state.finish(opt)
                checks += 1
                if not equal(list(ddp.parameters())):
                    bad.append(f"partial_hook {kind} {dtype}")
        dist.destroy_process_group()
    return checks


def main() -> None:
    bad: list[str] = []
    checks = asyncio.run(numpy_part(bad))
    if "--torch" in sys.argv:
        checks += torch_part(bad)
    rank = int(__import__("os").environ["ASYNCCOLL_RANK"])
    for what in bad:
        print(f"REPLICAS DIFFER {what}", flush=True)
    print(f"REPLICAS OK {rank} {checks}" if not bad else f"REPLICAS BAD {rank}", flush=True)


if __name__ == "__main__":
    main()
