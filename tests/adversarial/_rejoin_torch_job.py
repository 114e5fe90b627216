"""A torch job for tests/adversarial/test_rejoin.py: an MLP trained with the
DistributedOptimizer around Adam over a partial policy (POLICY) on 4 ranks; rank VICTIM
SIGKILLs itself at step KILL_AT of N on its first start and comes back under ``asynccoll run
--max-restarts``. With KILL_IN_SYNC=R, rank R SIGKILLs itself (once, on its first start) as it
enters the first sync event's parameter allreduce after step KILL_AT (the one that takes the
victim's restart back): the others lose it inside the event. With HOLD=k (tests/adversarial/
test_grow.py) every rank trains past N until it trains with k ranks. Every rank prints its
global step and a digest of its parameters and of Adam's state, and the size of its world."""
import hashlib
import os
import signal
import time

import torch

import asynccoll
from asynccoll.torch import DistributedOptimizer

N, KILL_AT = int(os.environ.get("N", 60)), int(os.environ.get("KILL_AT", 10))
VICTIM = int(os.environ.get("VICTIMS", "2"))
POLICY = os.environ.get("POLICY", "solo")


def die_in_sync_allreduce(opt, rank) -> None:
    """Past KILL_AT: SIGKILL this process as it enters a sync event's allreduce (the job's only
    ``Communicator.allreduce`` calls)."""
    from asynccoll.comm.communicator import Communicator
    allreduce = Communicator.allreduce

    async def dying(self, x, *args, **kwargs):
        if opt.step_count >= KILL_AT:
            print(f"rank {rank} dies in its sync event's allreduce", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return await allreduce(self, x, *args, **kwargs)

    Communicator.allreduce = dying


def main() -> None:
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = asynccoll.init()
    rank = comm.rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm,
                               policy=POLICY)  # (on a restart its broadcast does nothing)
    if os.environ.get("KILL_IN_SYNC") == str(rank) and not restarted:
        die_in_sync_allreduce(opt, rank)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True) * 0.1
    hold = int(os.environ.get("HOLD", "0"))
    while opt.step_count < N or opt.world_size < hold:
        if rank == VICTIM and not restarted and opt.step_count == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        info = opt.step()
        if info.joined:
            print(f"rank {rank} joined at step {opt.step_count} (from execution "
                  f"{info.round + 1})", flush=True)
        elif info.synced:  # (a planned event: in the step's own execution, this round)
            print(f"EVENT rank={rank} round={info.round}", flush=True)
        time.sleep(float(os.environ.get("STEP_S", 0.06)) * (1 + rank % 2))
    opt.finish()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for st in opt.optimizer.state.values():
        for k in sorted(st):
            h.update(st[k].detach().numpy().tobytes())
    print(f"WORLD rank={rank} size={opt.world_size}", flush=True)
    print(f"FINAL rank={rank} steps={opt.step_count} digest={h.hexdigest()[:16]} "
          f"restarted={restarted} loss={loss.item():.4f}", flush=True)
    comm.close()


main()
