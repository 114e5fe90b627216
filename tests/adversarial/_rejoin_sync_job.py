"""A training job for tests/adversarial/test_rejoin_sync.py: ODSGD (OPT=odsgd: warm-up 3,
momentum, DC-ASGD-a locally) or TopKSGD (OPT=topk: density 0.1, momentum) on 4 ranks; rank
VICTIM SIGKILLs itself at step KILL_AT of N on its first start. Under ``asynccoll run
--max-failures 1`` the survivors go on; with ``--max-restarts 1`` it comes back
(ASYNCCOLL_RESTART) and joins. Every rank prints one FINAL line with its global step and a
digest (:func:`asynccoll.comm.state_digest.digest`) of the replicated state: the global weights
(ODSGD: ``params`` after ``finish()``) and the momentum.

With HOLD_AT=s the other ranks wait at step s until the victim's restart has connected (at
most 60 s), so that a slow restart on a loaded machine still finds them training.

With THEN=r (and THEN_AT=s, default 50) rank r SIGKILLs itself at step s once the world is
whole again: a loss in the world the restarted rank joined.

With DROP_TO=r the victim does not die at once: from step KILL_AT on it sends none of its data
frames to rank r (a fault injected in the victim's own process; every survivor runs its real
transport) and SIGKILLs itself 0.5 s later. Over the recursive-doubling allreduce of ODSGD
the survivors other than r then complete the round that r cannot: the recovery must settle
it (its result from a survivor that has it), not redo it."""
import asyncio
import os
import signal
import threading
import time

import numpy as np

import asynccoll
from asynccoll.comm import joining
from asynccoll.train import ODSGD, TopKSGD

N, KILL_AT = int(os.environ.get("N", 60)), int(os.environ.get("KILL_AT", 10))
VICTIM = int(os.environ.get("VICTIM", "2"))
OPT = os.environ.get("OPT", "odsgd")


def drop_frames_to(comm, dst):
    """Send no data frame to ``dst`` from now on; SIGKILL this process 0.5 s later."""
    t = comm.transport
    post = t.post_frame

    def post_frame(to, kind, sched, execution, tag, payload, *args):
        if to == dst and memoryview(payload).nbytes >= 1000:
            return asyncio.get_running_loop().create_future()  # never sent
        return post(to, kind, sched, execution, tag, payload, *args)

    comm.in_runtime(lambda: setattr(t, "post_frame", post_frame))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    w0 = np.zeros(1000, np.float32)
    target = np.linspace(-1, 1, 1000, dtype=np.float32) * (rank + 1)
    if OPT == "odsgd":
        opt = ODSGD(comm, w0, 0.05, warmup=3, momentum=0.5, local="dc-asgd-a")
    else:
        opt = TopKSGD(comm, w0, 0.05, density=0.1, momentum=0.5)
    t0 = time.time()
    back, loop = asyncio.Event(), asyncio.get_running_loop()  # the victim's restart connected
    comm.in_runtime(lambda: comm.membership.join_listeners.append(
        lambda r: loop.call_soon_threadsafe(back.set)))
    while opt.step_count < N:
        if rank == VICTIM and not restarted and opt.step_count == KILL_AT:
            if "DROP_TO" not in os.environ:
                os.kill(os.getpid(), signal.SIGKILL)
            drop_frames_to(comm, int(os.environ["DROP_TO"]))
        if rank == int(os.environ.get("THEN", -1)) and opt.world_size == 4 \
                and opt.step_count == int(os.environ.get("THEN_AT", 50)):
            os.kill(os.getpid(), signal.SIGKILL)
        if opt.step_count == int(os.environ.get("HOLD_AT", -1)) and rank != VICTIM:
            await asyncio.wait_for(back.wait(), 60)
        info = await opt.step((opt.params - target) * 0.5)
        if info.joined:
            print(f"rank {rank} joined at step {opt.step_count}", flush=True)
        await asyncio.sleep(float(os.environ.get("STEP_S", 0.04)) * (1 + rank % 2))
    await opt.finish()
    d = joining.digest([opt.params, *opt._state()])
    print(f"FINAL rank={rank} steps={opt.step_count} digest={d:x} restarted={restarted} "
          f"world={opt.world_size} t={time.time() - t0:.2f}", flush=True)
    await comm.close()

asyncio.run(main())
