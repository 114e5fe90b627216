"""A training job for tests/adversarial/test_rejoin.py: eager-SGD on 4 ranks; the ranks named in
VICTIMS SIGKILL themselves at step KILL_AT of N on their first start; under ``asynccoll run
--max-restarts`` they come back (ASYNCCOLL_RESTART) and join. With KILL_JOINING=s a first
restart SIGKILLs itself s seconds after it connected (while it joins). With CHURN=k, a rank
drawn from the step number SIGKILLs itself every CHURN_EVERY steps, k times (a restarted
process too, at steps after the one it joined at). Every rank prints one FINAL line
with its global step and a digest of its parameters."""
import asyncio
import hashlib
import os
import signal
import time

import numpy as np

import asynccoll
from asynccoll import EagerSGD

N, KILL_AT = int(os.environ.get("N", 60)), int(os.environ.get("KILL_AT", 10))
VICTIMS = [int(v) for v in os.environ.get("VICTIMS", "2").split(",")]
POLICY = os.environ.get("POLICY", "solo")


def optimizer(comm, w0):
    import inspect
    if "policy" not in inspect.signature(EagerSGD.__init__).parameters:  # before policies
        return EagerSGD(comm, w0, 0.1, POLICY, momentum=0.5,  # were values
                        quorum=3 if POLICY == "quorum" else None)
    from asynccoll import Majority, Quorum, Solo
    policy = {"solo": Solo(), "majority": Majority(), "quorum": Quorum(3)}[POLICY]
    return EagerSGD(comm, w0, 0.1, policy, momentum=0.5)


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    if restarted == 1 and os.environ.get("KILL_JOINING"):
        # killed again while it joins: after it said it is ready, before the state is in
        import threading
        delay = float(os.environ["KILL_JOINING"])
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    w0 = np.zeros(1000, np.float32)
    target = np.linspace(-1, 1, 1000, dtype=np.float32) * (rank + 1)
    opt = optimizer(comm, w0)
    t0 = time.time()
    joined = None
    churn = int(os.environ.get("CHURN", "0"))  # kills: one every CHURN_EVERY steps
    every = int(os.environ.get("CHURN_EVERY", "25"))
    first = None  # this process's first global step
    while opt.step_count < N:
        if rank in VICTIMS and not restarted and opt.step_count == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        s = opt.step_count
        if churn and first is not None and s > first and s % every == 0 and s // every <= churn \
                and int(hashlib.sha256(f"{s}".encode()).hexdigest(), 16) % 4 == rank:
            print(f"CHURN kill rank {rank} at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = (opt.params - target) * 0.5
        info = await opt.step(g)
        if first is None:
            first = opt.step_count  # (a restarted process: the step it joined at)
        if info.joined:
            joined = opt.step_count
            print(f"rank {rank} joined at step {joined}", flush=True)
        await asyncio.sleep(float(os.environ.get("STEP_S", 0.08)) * (1 + rank % 2))
    await opt.finish()
    d = hashlib.sha256(opt.params.tobytes()).hexdigest()[:16]
    print(f"FINAL rank={rank} steps={opt.step_count} digest={d} restarted={restarted} "
          f"t={time.time() - t0:.2f}", flush=True)
    await comm.close()

asyncio.run(main())
