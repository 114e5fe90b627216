"""An MLP on scikit-learn's bundled digits under severe load imbalance (eager-SGD §7.2.3).

    pip install 'asynccoll[torch]'        # torch (CPU) and scikit-learn; no download
    asynccoll run -n 4 examples/torch_digits.py [--policies sync,majority] [--steps 150]

PyTorch on the CPU. Every rank trains the same MLP on its shard of the 8x8 digits with
``EagerSGD``; the parameters are fused into one bucket (the model's tensors become views of it).
Severe imbalance, shifted injection: on global step ``e`` rank ``r`` is slowed by
``levels[(r + e) % P]``, levels spread evenly from 0.25c to 2c, so every rank is skewed on every
step and the slowest one moves around. ``c`` (``--step-ms``) simulates the accelerator's time;
this machine has 2 CPU cores and no GPU. Rank 0 prints test accuracy against wall time for
each policy, then a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import asynccoll
from asynccoll.train import EagerSGD


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


async def train(comm: asynccoll.Communicator, policy: str, args: argparse.Namespace,
                data: tuple[torch.Tensor, ...]) -> tuple[float, float, int]:
    Xtr, ytr, Xte, yte = data
    net = model(args.seed)
    params = list(net.parameters())
    opt = EagerSGD(comm, params, policy=policy, lr=args.lr, name=f"digits-{policy}",
                   accumulate=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    P, c = comm.size, args.step_ms / 1000
    levels = np.linspace(0.25, 2.0, P) * c
    shard = torch.arange(comm.rank, len(Xtr), P)
    gen = torch.Generator().manual_seed(args.seed + comm.rank)

    def accuracy() -> float:
        with torch.no_grad():
            return float((net(Xte).argmax(1) == yte).float().mean())

    await comm.barrier()
    t0 = time.perf_counter()
    last = -1
    while last < args.steps - 1:
        t = time.perf_counter()
        idx = shard[torch.randint(len(shard), (args.batch,), generator=gen)]
        net.zero_grad()
        loss_fn(net(Xtr[idx]), ytr[idx]).backward()
        pause = c - (time.perf_counter() - t) + levels[(comm.rank + last + 1) % P]
        await asyncio.sleep(max(pause, 0.0))
        info = await opt.step([p.grad for p in params])
        last = max(last, info.round)
        if comm.rank == 0 and info.round % 25 == 0:
            print(f"{policy:>8} t={time.perf_counter() - t0:6.2f}s step {last:4d} "
                  f"test accuracy {accuracy():.3f}")
    wall = time.perf_counter() - t0
    await opt.finish()
    return wall, accuracy(), last + 1


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    comm = await asynccoll.connect()
    async with comm:
        X, y = load_digits(return_X_y=True)
        Xtr, Xte, ytr, yte = train_test_split(X / 16.0, y, test_size=0.25,
                                              random_state=args.seed, stratify=y)
        data = (torch.tensor(Xtr, dtype=torch.float32), torch.tensor(ytr),
                torch.tensor(Xte, dtype=torch.float32), torch.tensor(yte))
        if comm.rank == 0:
            print(f"{comm.size} ranks; accelerator time simulated as a {args.step_ms:g} ms sleep "
                  "(2 CPU cores, no GPU); shifted injection from 0.25c to 2c")
        results = {m: await train(comm, m, args, data) for m in args.policies.split(",")}
        if comm.rank == 0:
            base = results.get("sync")
            for m, (wall, acc, steps) in results.items():
                rel = f", {base[0] / wall:.2f}x the speed of sync" if base else ""
                print(f"{m:>8}: {steps} steps in {wall:.2f} s ({steps / wall:.2f} steps/s"
                      f"{rel}), test accuracy {acc:.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="sync,majority",
                   help="comma-separated policies to compare (default: %(default)s)")
    p.add_argument("--steps", type=int, default=150, help="global steps per policy")
    p.add_argument("--batch", type=int, default=32, help="batch per rank")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated accelerator time")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
