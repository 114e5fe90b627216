"""A training job for tests/adversarial/test_grow.py: eager-SGD that a second node's launcher
joins while it trains (``asynccoll run --nnodes 1:2``). Every rank loops on the global step
(``while opt.step_count < N``) with SYNC_EVERY steps between sync events, and prints one GREW
line the first time it trains in a bigger world, then one FINAL line with its global step, the
world it ended in and a digest of its parameters. With STEP_SLEEP seconds per step (default
0.02) the members are still training when the second node's ranks join; with HOLD=k every
rank trains past N until its world has k ranks, and 10 steps more (the test's members wait for
the new node). With
KILL_JOINING=1 the first process of rank 2 (a new rank) SIGKILLs itself while it is taken in:
once the members' header came, as it would receive their state (its launcher restarts it under
--max-restarts). With SPLIT_JOIN=1 the admission splits: rank 2's first process dies a second
after the header (once rank 0's stripe went out), and rank 1 sends its stripe two seconds after
the header: rank 0 took rank 2 in, rank 1 lost it while taking it in."""
import asyncio
import hashlib
import os
import signal

import numpy as np

import asynccoll
from asynccoll import EagerSGD, Solo

N = int(os.environ.get("N", 150))
SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
HOLD = int(os.environ.get("HOLD", "0"))


async def main():
    comm = await asynccoll.connect()
    rank = comm.rank
    if rank == 2 and os.environ.get("KILL_JOINING") and not os.environ.get("ASYNCCOLL_RESTART"):
        from asynccoll.comm import joining

        def dying(*args, **kwargs):
            print("rank 2 dies as it would receive the state", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        async def dying_later(*args, **kwargs):
            await asyncio.sleep(1.0)
            dying()

        joining.take_all = dying_later if os.environ.get("SPLIT_JOIN") else dying
    if rank == 1 and os.environ.get("SPLIT_JOIN"):
        from asynccoll.comm import joining

        give = joining.give

        async def late_give(*args, **kwargs):
            await asyncio.sleep(2.0)
            await give(*args, **kwargs)

        joining.give = late_give
    w0 = np.zeros(1000, np.float32)
    target = np.linspace(-1, 1, 1000, dtype=np.float32) * (rank + 1)
    opt = EagerSGD(comm, w0, 0.1, Solo(), momentum=0.5,
                   sync_every=int(os.environ.get("SYNC_EVERY", "5")))
    first_world = None
    grew = False
    held = None  # the first step trained with HOLD ranks: 10 more at least (a rank lost as it
    while opt.step_count < N or opt.world_size < HOLD or (  # was taken in is noticed first)
            HOLD and (held is None or opt.step_count < held + 10)):
        if HOLD and held is None and opt.world_size >= HOLD:
            held = opt.step_count
        info = await opt.step(opt.params - target)
        if first_world is None:
            first_world = opt.world_size
        elif opt.world_size > first_world and not grew:
            grew = True
            print(f"GREW rank={rank} step={opt.step_count} world={opt.world_size}", flush=True)
        if getattr(info, "joined", False):
            print(f"JOINED rank={rank} step={opt.step_count} world={opt.world_size}",
                  flush=True)
        await asyncio.sleep(SLEEP)
    await opt.finish()
    digest = hashlib.sha256(opt.params.tobytes()).hexdigest()[:16]
    print(f"FINAL rank={rank} step={opt.step_count} world={opt.world_size} digest={digest}",
          flush=True)
    await comm.close()


asyncio.run(main())
