"""Hyperplane regression with eager-SGD (eager-SGD §7.2.1), NumPy only.

    asynccoll run -n 4 examples/hyperplane.py [--policy solo] [--dim 256] [--steps 60]
                                               [--step-ms 50] [--delay 1.0]

Every rank fits a linear model to ``y = a . x + noise`` on its own shard with real NumPy
gradients. This machine has 2 CPU cores and no GPU, so the accelerator's time per step is
simulated by a sleep of ``--step-ms`` (minus the real gradient time); on every global step one
rank, drawn by a generator seeded identically on all ranks, sleeps ``--delay`` times longer
(the load imbalance). Compare ``--policy sync`` with ``--policy solo`` and ``--policy
majority`` (any policy's text: ``quorum:3``, ``deadline``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import asynccoll
from asynccoll.collectives.policy import POLICY_SYNTAX
from asynccoll.train import EagerSGD


async def main(args: argparse.Namespace) -> None:
    comm = await asynccoll.connect()
    async with comm:
        rng = np.random.default_rng(args.seed)  # the same data set on every rank
        a = rng.standard_normal(args.dim)
        X = rng.standard_normal((comm.size * args.batch * 8 + 1024, args.dim))
        y = X @ a + rng.standard_normal(len(X))
        Xv, yv = X[-1024:], y[-1024:]
        shard = slice(comm.rank * args.batch * 8, (comm.rank + 1) * args.batch * 8)
        Xs, ys = X[shard], y[shard]

        w = np.zeros(args.dim)
        opt = EagerSGD(comm, w, policy=args.policy, lr=args.lr, accumulate=True)
        c = args.step_ms / 1000
        if comm.rank == 0:
            print(f"{comm.size} ranks, policy {opt.policy}; the accelerator is simulated by a "
                  f"{args.step_ms:g} ms sleep per step (2 CPU cores, no GPU here)")
        await comm.barrier()
        t0 = time.perf_counter()
        last, local = -1, 0
        while last < args.steps - 1:
            t = time.perf_counter()
            b = slice((local % 8) * args.batch, (local % 8 + 1) * args.batch)
            g = Xs[b].T @ (Xs[b] @ w - ys[b]) / args.batch  # real gradient
            straggler = int(np.random.default_rng((args.seed, last + 1)).integers(comm.size))
            pause = c - (time.perf_counter() - t) + (args.delay * c
                                                       if straggler == comm.rank else 0.0)
            await asyncio.sleep(max(pause, 0.0))
            info = await opt.step(g)
            last, local = max(last, info.round), local + 1
            if comm.rank == 0 and local % 10 == 0:
                r = Xv @ w - yv
                print(f"t={time.perf_counter() - t0:6.2f}s round {last:4d}  val MSE "
                      f"{r @ r / len(r):9.4f}  contributors {sorted(info.contributors)}")
        wall = time.perf_counter() - t0
        await opt.finish()  # apply everything still in flight; replicas equal afterwards
        if comm.rank == 0:
            r = Xv @ w - yv
            print(f"done: {last + 1} global steps in {wall:.2f} s = {(last + 1) / wall:.2f} "
                  f"steps/s; final validation MSE {r @ r / len(r):.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="solo",
                   help=f"the straggler policy (default: %(default)s): {POLICY_SYNTAX}")
    p.add_argument("--dim", type=int, default=256, help="dimension (the paper: 8192)")
    p.add_argument("--batch", type=int, default=128, help="batch per rank")
    p.add_argument("--steps", type=int, default=60, help="global steps")
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated accelerator time")
    p.add_argument("--delay", type=float, default=1.0, help="injected delay, in step times")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
