"""A small convolutional network on scikit-learn's digits under DDP with ``partial_hook``.

    pip install 'asynccoll[torch]'          # torch (CPU) and scikit-learn; no download
    asynccoll run -n 4 examples/torch_ddp.py --policy majority
    torchrun --nproc_per_node 4 examples/torch_ddp.py --policy majority

A plain synchronous PyTorch loop: ``DistributedDataParallel`` over a Gloo process group (for
DDP's own setup) with asynccoll's communication hook, ``loss.backward(); opt.step()``.
``--policy gloo`` keeps DDP's default hook (the baseline a PyTorch user has today); a policy's
text (``sync``, ``solo``, ``majority``, ``two_choice``, ``quorum:3``, ``deadline:3``:
:func:`asynccoll.as_policy`) runs asynccoll's hook with it. ``--optimizer`` drops DDP and
wraps the same SGD in ``DistributedOptimizer(opt, comm, policy)`` instead (any policy,
``backup:1`` too); ``--algorithm rna`` or ``odsgd`` (implies ``--optimizer``) runs that
algorithm, over its default policy unless ``--policy`` is given. Each runs with its default
averaging. Stragglers are
injected as in eager-SGD §7.2.3: the accelerator's time is simulated by a sleep up to ``c``
(``--step-ms``; this machine has 2 CPU cores and no GPU) and on every step one rank, drawn
from a generator seeded alike on all ranks, sleeps ``D = --delay * c`` more. Rank 0 prints test
accuracy against wall time, and with ``--json FILE`` writes the curve there.

``--steps`` defaults to 400 (``torch_adam.py``: 150). At 150 steps, this example's default
until 2026-11-29, the network was still on the steep part of its learning curve: evaluations
2 steps apart differed by 5-6 points of test accuracy on average, so one final reading said
little about a run (``examples/torch_accuracy.py`` says why). By 400 steps Gloo's run is on its
plateau (0.95-0.96 on seeds 0-2), where they differ by about one point.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll
from asynccoll.collectives.policy import POLICY_SYNTAX
from asynccoll.torch import (
    DistributedOptimizer,
    broadcast_parameters,
    init_process_group,
    partial_hook,
)
from asynccoll.torch.optimizer import ALGORITHMS

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def digits(seed: int) -> Data:
    """The 8x8 digits as ``(1, 8, 8)`` images: train and test tensors (no download)."""
    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X / 16.0, y, test_size=0.25, random_state=seed,
                                          stratify=y)
    def img(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 8, 8)

    return img(Xtr), torch.tensor(ytr), img(Xte), torch.tensor(yte)


def convnet(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10))


def add_arguments(p: argparse.ArgumentParser, *, steps: int = 150) -> None:
    """The options both examples share; ``steps`` is the example's default ``--steps``."""
    p.add_argument("--steps", type=int, default=steps, help="steps per rank")
    p.add_argument("--batch", type=int, default=32, help="batch per rank")
    p.add_argument("--step-ms", type=float, default=40.0, help="simulated accelerator time c")
    p.add_argument("--delay", type=float, default=1.0,
                   help="one straggler per step is delayed by DELAY * c (0: none)")
    p.add_argument("--eval-every", type=int, default=2,
                   help="steps between points of the accuracy curve (evaluated after the loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes its curve and summary here")


def train(rank: int, P: int, model: torch.nn.Module, step: Callable[[torch.Tensor], Any],
          args: argparse.Namespace, data: Data, label: str) -> dict[str, Any]:
    """The synchronous loop both examples run: ``step(loss)`` does backward and the update.

    Returns rank 0's curve: ``(seconds, step, test accuracy)`` every ``--eval-every`` steps.
    The test accuracy is not measured inside the timed loop (an evaluation there would make
    rank 0 a straggler of its own, and delay every rank of a synchronous run): rank 0 keeps a
    copy of its parameters and the time at each point of the curve, and evaluates the copies
    after the loop.
    """
    Xtr, ytr, Xte, yte = data
    c, D = args.step_ms / 1000, args.delay * args.step_ms / 1000
    shard = torch.arange(rank, len(Xtr), P)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    stragglers = np.random.default_rng(args.seed).integers(P, size=args.steps)
    params = list(model.parameters())

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(Xte).argmax(1) == yte).float().mean())

    copies: list[tuple[float, int, list[torch.Tensor]]] = []
    t0 = time.perf_counter()
    for s in range(args.steps):
        t = time.perf_counter()
        idx = shard[torch.randint(len(shard), (args.batch,), generator=gen)]
        loss = torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx])
        pause = c - (time.perf_counter() - t) + (D if stragglers[s] == rank else 0.0)
        time.sleep(max(pause, 0.0))
        step(loss)
        if rank == 0 and (s + 1) % args.eval_every == 0:
            copies.append((time.perf_counter() - t0, s + 1, [p.detach().clone() for p in params]))
    wall = time.perf_counter() - t0
    curve: list[tuple[float, int, float]] = []
    final = [p.detach().clone() for p in params]
    with torch.no_grad():
        for t, s, saved in copies:
            for p, v in zip(params, saved, strict=True):
                p.copy_(v)
            curve.append((t, s, accuracy()))
            if s % (50 if args.eval_every < 10 else 5 * args.eval_every) == 0 \
                    or s == args.steps:
                print(f"{label:>12} t={t:6.2f}s step {s:4d} test accuracy {curve[-1][2]:.3f}",
                      flush=True)
        for p, v in zip(params, final, strict=True):
            p.copy_(v)
    return {"label": label, "wall": wall, "curve": curve, "steps": args.steps,
            "accuracy": accuracy()}


def report(rank: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    if rank != 0:
        return
    print(f"{out['label']:>12}: {out['steps']} steps in {out['wall']:.2f} s "
          f"({out['wall'] / out['steps'] * 1000:.1f} ms/step), final test accuracy "
          f"{out['accuracy']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "args": vars(args)}, f)


def wrapped(args: argparse.Namespace) -> None:
    """``--optimizer``: no DDP; the SGD wrapped in ``DistributedOptimizer``."""
    policy = args.policy if args.policy is not None or args.algorithm else "majority"
    with asynccoll.init() as comm:
        data = digits(args.seed)
        net = convnet(args.seed + comm.rank)  # the wrapper broadcasts rank 0's parameters
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=args.lr), comm,
                                   policy, algorithm=args.algorithm)

        def step(loss: torch.Tensor) -> None:
            opt.zero_grad()
            loss.backward()
            opt.step()

        out = train(comm.rank, comm.size, net, step, args, data,
                    f"opt-{args.algorithm or opt.policy}")
        opt.finish()  # collective: drain, apply, average the replicas
        with torch.no_grad():
            out["accuracy"] = float((net(data[2]).argmax(1) == data[3]).float().mean())
        report(comm.rank, args, out)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    if args.optimizer or args.algorithm is not None:
        wrapped(args)
        return
    kind = args.policy or "majority"
    with asynccoll.init() as comm:  # asynccoll run, torchrun or SLURM: from the environment
        init_process_group(comm)  # Gloo, for DDP's own setup
        try:
            data = digits(args.seed)
            net = convnet(args.seed + comm.rank)  # seeded differently on purpose:
            broadcast_parameters(net, root=0, comm=comm)  # replicas start equal
            ddp = DDP(net)
            state = None
            if kind != "gloo":
                state, hook = partial_hook(comm, kind,
                                           **({} if args.average is None
                                              else {"average": args.average}))
                ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

            def step(loss: torch.Tensor) -> None:
                opt.zero_grad()
                loss.backward()
                opt.step()

            label = f"ddp-{kind}"
            out = train(comm.rank, comm.size, ddp, step, args, data, label)
            if state is not None:
                state.finish(opt)  # collective: what is still in flight, applied everywhere
                with torch.no_grad():
                    out["accuracy"] = float((ddp(data[2]).argmax(1) == data[3]).float().mean())
                out["stale_buckets"] = sum(b.staleness > 0 for b in state.buckets.values())
            report(comm.rank, args, out)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=None,
                   help="DDP's hook: gloo (DDP's default) or partial_hook's policy (default "
                        f"majority): {POLICY_SYNTAX}")
    p.add_argument("--optimizer", action="store_true",
                   help="no DDP: SGD in DistributedOptimizer(opt, comm, POLICY) instead")
    p.add_argument("--algorithm", default=None, choices=ALGORITHMS,
                   help="DistributedOptimizer's algorithm (implies --optimizer)")
    p.add_argument("--average", default=None, choices=("contributions", "world"),
                   help="partial_hook's averaging of each round (default: the hook's, world)")
    p.add_argument("--lr", type=float, default=0.1)
    add_arguments(p, steps=400)
    main(p.parse_args())
