"""A DDP job for tests/adversarial/test_rejoin.py: an MLP under ``DistributedDataParallel``
with asynccoll's ``partial_hook`` (POLICY) on 4 ranks, Adam stepping it, small buckets (two
after DDP's first step: two bucket handles take the joiner back). Each rank of VICTIMS
SIGKILLs itself at step KILL_AT of N on its first start and comes back under ``asynccoll run
--max-restarts``. One script for first starts and restarts: nothing in it asks whether this
process is a restart but the kill. Every rank prints its global step and a digest of its
parameters and of Adam's state. ``CHURN=k``: instead, kill number j = 1, 2, ... (up to
``KILLS``) at global step j * k takes rank (j - 1) % 4 (each process kills itself once at
most, at the first such step past its start). ``HOLD=k`` (tests/adversarial/test_grow.py):
every rank trains past N until it trains with k ranks."""
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll
from asynccoll.torch import broadcast_parameters, init_process_group, partial_hook

N, KILL_AT = int(os.environ.get("N", 60)), int(os.environ.get("KILL_AT", 10))
VICTIMS = [int(v) for v in os.environ.get("VICTIMS", "2").split(",")]
POLICY = os.environ.get("POLICY", "solo")


def main() -> None:
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    torch.set_num_threads(1)
    comm = asynccoll.init()
    rank = comm.rank
    init_process_group(comm)  # a one-rank group per process in a job that takes ranks back
    torch.manual_seed(rank)  # different on purpose: broadcast_parameters makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 1))
    broadcast_parameters(model, 0, comm=comm)  # (nothing on a restarted process: it joins)
    ddp = DDP(model, bucket_cap_mb=0.001, broadcast_buffers=False)
    state, hook = partial_hook(comm, POLICY)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True) * 0.1
    joined_at = None
    churn, kills = int(os.environ.get("CHURN", 0)), int(os.environ.get("KILLS", 5))
    die_at = None
    hold = int(os.environ.get("HOLD", "0"))  # (test_grow: train on until HOLD ranks do)
    while state.step_count < N or (hold and state._comm_now().size < hold):
        if churn and die_at is None and state.step_count > 0:  # (on a joiner: the members')
            die_at = next((j * churn for j in range(1, kills + 1)
                           if (j - 1) % 4 == rank and j * churn > state.step_count), N + 1)
        if (rank in VICTIMS and not restarted and state.step_count == KILL_AT) or \
                (die_at is not None and state.step_count >= die_at):
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if restarted and joined_at is None and state.step_count > 1:
            joined_at = state.step_count
            print(f"rank {rank} joined at step {joined_at}", flush=True)
        time.sleep(float(os.environ.get("STEP_S", 0.06)) * (1 + rank % 2))
    state.finish(opt)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            h.update(st[k].detach().numpy().tobytes())
    print(f"FINAL rank={rank} steps={state.step_count} digest={h.hexdigest()[:16]} "
          f"restarted={restarted} buckets={len(state.bucket_handles())} syncs={state.syncs} "
          f"loss={loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    comm.close()


try:
    main()
except BaseException:  # to stdout as well: under asynccoll run only the cause's is printed
    import traceback

    traceback.print_exc(file=sys.stdout)
    raise
