"""Rank program of the CUDA-tensor DDP-hook test (module-level, for the spawn context)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll
from asynccoll.torch import init_process_group, partial_hook


def _flat(m: torch.nn.Module) -> list[float]:
    """The parameters as plain floats (tensors through the result queue would be shared
    through memory that dies with the child)."""
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).cpu().tolist()


def _train(rank: int, steps: int, hook: Any = None) -> tuple[DDP, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4)).double().cuda()
    ddp = DDP(net, bucket_cap_mb=0.0002)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        gen = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64).cuda()
        opt.zero_grad()
        ddp(x).square().sum().backward()
        opt.step()
    return ddp, opt


def cuda_ddp_main(rank: int, P: int, port: int) -> dict[str, Any]:
    """DDP on CUDA tensors: its default hook against ``partial_hook("sync")`` and a solo
    hook finished with its optimizer; returns flat parameters (on the host) to compare."""
    out: dict[str, Any] = {}
    with asynccoll.init(rank=rank, world_size=P, store=f"127.0.0.1:{port}", timeout=60,
                        collective_timeout=60) as comm:
        init_process_group(comm)  # gloo: it reduces CUDA tensors too
        try:
            base, _ = _train(rank, 5)
            out["default"] = _flat(base.module)
            state, hook = partial_hook(comm, "sync", name="cuda-sync")
            ddp, _ = _train(rank, 5, (state, hook))
            out["sync"] = _flat(ddp.module)
            out["sync_device"] = str(next(ddp.module.parameters()).device)
            state, hook = partial_hook(comm, "solo", name="cuda-solo")
            ddp, opt = _train(rank, 5, (state, hook))
            state.finish(opt)
            out["solo"] = _flat(ddp.module)
        finally:
            torch.distributed.destroy_process_group()
    return out
