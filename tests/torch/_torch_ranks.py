"""Rank programs of the multi-process PyTorch tests (module-level, for the spawn context)."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _helpers import SECRET
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll
from asynccoll import Majority, Quorum, TwoChoice
from asynccoll.collectives.partial import initiators
from asynccoll.testing import policy_of
from asynccoll.torch import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    init_process_group,
    partial_hook,
)
from asynccoll.train import EagerSGD


def sync_child(rank: int, P: int, main: Callable[..., Any], *rest: Any) -> None:
    """Spawned-process entry: ``main(rank, P, *args)`` with the test secret set; reports on
    the queue (the last of ``rest``) ``(rank, "ok", result)`` or ``(rank, "error", tb)``."""
    *args, q = rest
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        torch.set_num_threads(1)
        q.put((rank, "ok", main(rank, P, *args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _join(rank: int, P: int, port: int) -> Any:
    return asynccoll.init(rank=rank, world_size=P, store=f"127.0.0.1:{port}", timeout=60,
                          collective_timeout=60)


class Net(torch.nn.Module):
    """Three linear maps side by side: with a loss linear in the output, every gradient is
    integer-valued for integer inputs, whatever the parameters (so sums are exact)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(8, 4)
        self.c = torch.nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x), self.c(x)], 1)


def _flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _train_ddp(rank: int, steps: int, hook: Any = None, delay: Callable[[int], float] | None
               = None, dtype: torch.dtype = torch.float32) -> tuple[DDP, Any, list[int], int]:
    net = Net(0).to(dtype)
    ddp = DDP(net, bucket_cap_mb=0.0002)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    counts: list[int] = []
    stale = 0
    for s in range(steps):
        gen = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randint(-3, 4, (5, 8), generator=gen).to(dtype)
        w = torch.randint(-2, 3, (5, 52), generator=gen).to(dtype)
        opt.zero_grad()
        loss = (ddp(x) * w).sum()
        if delay is not None:  # after the forward pass, where DDP may sync (bucket rebuild)
            time.sleep(delay(s))
        loss.backward()
        opt.step()
        if hook is not None:
            counts.append(sum(b.count for b in hook[0].buckets.values()))
            stale = max(stale, *(b.staleness for b in hook[0].buckets.values()))
    return ddp, opt, counts, stale


def ddp_main(rank: int, P: int, port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _join(rank, P, port) as comm:
        init_process_group(comm)
        try:
            # DDP's default hook (Gloo) against partial_hook("sync"): bit-identical
            base, _, _, _ = _train_ddp(rank, 20)
            ref = _flat(base.module)
            state, hook = partial_hook(comm, "sync", name="sync")
            ddp, _, _, _ = _train_ddp(rank, 20, (state, hook))
            out["sync_equal"] = bool(torch.equal(_flat(ddp.module), ref))
            out["buckets"] = len(state.buckets)
            # no stragglers: quorum(P) equals sync, and majority too when its drawn initiator
            # arrives last (every round then holds every rank's fresh gradient). Solo and
            # two_choice rounds start at the first of several initiators, so the others'
            # gradients may go to the next round even without stragglers: for them the
            # conservation and replica checks below are what holds.
            steps = 6
            short, _, _, _ = _train_ddp(rank, steps)
            ref = _flat(short.module)
            for kind in ("quorum", "majority"):
                seed = 7

                def late_initiator(s: int, kind: str = kind, seed: int = seed) -> float:
                    if kind == "quorum" or s == 0:
                        return 0.0
                    # long enough for every other rank's hook to arrive first on a loaded
                    # machine (0.15 s left a margin a stall of that size undid)
                    return 0.4 if rank in initiators(kind, s - 1, P, seed) else 0.0

                policy = {"quorum": Quorum(P), "majority": Majority(seed=seed),
                          "two_choice": TwoChoice(seed=seed)}.get(kind, kind)
                state, hook = partial_hook(comm, policy, name=f"eq-{kind}")
                ddp, opt, counts, _ = _train_ddp(rank, steps, (state, hook), late_initiator)
                held = state.finish(opt)
                out[f"{kind}_equal"] = bool(torch.equal(_flat(ddp.module), ref)) and held == 0
                out[f"{kind}_full"] = counts[1:] == [P * len(state.buckets)] * (steps - 1)
            # injected stragglers: replicas equal after finish(), contributions conserved
            for kind, average in (("solo", "contributions"), ("majority", "contributions"),
                                  ("two_choice", "contributions"),
                                  ("quorum", "contributions"), ("solo", "world")):
                key = f"{kind}-{average}"
                state, hook = partial_hook(comm, Quorum(P - 1) if kind == "quorum" else kind,
                                           name=f"strag-{key}", average=average)
                ddp, opt, counts, stale = _train_ddp(rank, 10, (state, hook),
                                              lambda s: 0.06 if s % P == rank else 0.0,
                                              dtype=torch.float64)
                held = state.finish(opt)
                flat = _flat(ddp.module)
                rows = comm.allgather(flat)
                out[f"{key}_spread"] = float((rows - rows[0]).abs().max())
                out[f"{key}_conserved"] = sum(counts) + held == P * state.calls
                out[f"{key}_stale"] = stale
        finally:
            dist.destroy_process_group()
    return out


def _lsq(rank: int, P: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    X = rng.normal(size=(32, 6))
    y = X @ np.arange(6.0) + rng.normal(scale=0.1, size=32)
    return X, y


def optimizer_main(rank: int, P: int, port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _join(rank, P, port) as comm:
        X, y = _lsq(rank, P)
        Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
        # DistributedOptimizer(SGD) against the built-in EagerSGD, float64 least squares
        for mode, q in (("sync", None), ("quorum", P)):
            w_np = np.zeros(6)
            eager = EagerSGD(comm.comm, w_np, policy=policy_of(mode, q), lr=0.05, accumulate=True,
                             average="contributions", name=f"eager-{mode}")
            w_t = torch.zeros(6, dtype=torch.float64, requires_grad=True)
            dopt = DistributedOptimizer(torch.optim.SGD([w_t], lr=0.05), comm,
                                        policy_of(mode, q), name=f"dopt-{mode}")
            for _ in range(20):
                g = X.T @ (X @ w_np - y) / len(y)
                comm.submit(eager.step(g)).result()
                dopt.zero_grad()
                (0.5 * ((Xt @ w_t - yt) ** 2).mean()).backward()
                dopt.step()
            comm.submit(eager.finish(average=False)).result()
            dopt.finish(average=False)
            out[f"sgd_{mode}_diff"] = float(np.abs(w_t.detach().numpy() - w_np).max())
        # Adam: sync against majority with a straggler per step, same accuracy
        from sklearn.datasets import load_digits

        Xd, yd = load_digits(return_X_y=True)
        Xd = torch.tensor(Xd / 16.0, dtype=torch.float32)
        yd = torch.tensor(yd)
        test = slice(1500, None)
        for mode in ("sync", "majority"):
            torch.manual_seed(rank)  # differently seeded: the constructor broadcasts rank 0's
            net = torch.nn.Linear(64, 10)
            dopt = DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01), comm,
                                        mode, name=f"adam-{mode}")
            gen = torch.Generator().manual_seed(rank)
            infos = []
            for s in range(60):
                idx = torch.randint(0, 1500, (32,), generator=gen)
                dopt.zero_grad()
                torch.nn.functional.cross_entropy(net(Xd[idx]), yd[idx]).backward()
                if s % P == rank:
                    time.sleep(0.02)
                infos.append(dopt.step())
            dopt.finish()
            with torch.no_grad():
                acc = float((net(Xd[test]).argmax(1) == yd[test]).float().mean())
            out[f"adam_{mode}_acc"] = acc
            rows = comm.allgather(torch.cat([p.detach().reshape(-1)
                                             for p in net.parameters()]))
            out[f"adam_{mode}_spread"] = float((rows - rows[0]).abs().max())
            out[f"adam_{mode}_rounds"] = len({i.round for i in infos})
        # broadcast_parameters: differently seeded replicas become root's
        torch.manual_seed(100 + rank)
        net = Net(100 + rank)
        broadcast_parameters(net, root=1, comm=comm)
        rows = comm.allgather(_flat(net))
        out["bcast_equal"] = bool(all(torch.equal(rows[r], rows[1]) for r in range(P)))
        out["bcast_is_root"] = bool(torch.equal(rows[1], _flat(Net(101))))
        opt = torch.optim.Adam(net.parameters(), lr=0.1 * (rank + 1))
        if rank == 1:
            net(torch.ones(1, 8)).sum().backward()
            opt.step()
        broadcast_optimizer_state(opt, root=1, comm=comm)
        out["opt_lr"] = opt.param_groups[0]["lr"]
        out["opt_state"] = len(opt.state)
    return out
